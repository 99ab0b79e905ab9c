"""The Overview's charts (issue 35.4): a lone minute is a dot, the share chart's legend lists the
tenants with tokens in the hour (a suspended one marked), and TTFT p50 stays readable beside a
p99 a hundred times larger. The browser checks are in test_browser_charts.py."""

from __future__ import annotations

import math
import re

import pytest

from loraplex.platform import tenants as service
from loraplex.webui.charts import HEIGHT, Chart, line_chart
from loraplex.webui.live import LiveRecorder, Window
from loraplex.webui.overview import charts
from tests.utils.web import WebEnv, sign_in

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self, now: float = 100_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def ys(chart: Chart, label: str) -> list[float]:
    """Every y (viewBox units, 0 = top) of the polylines of ``label``'s line."""
    (line,) = [line for line in chart.lines if line.label == label]
    return [float(p.split(",")[1]) for seg in line.segments for p in seg.split()]


def spiky_window() -> Window:
    """An hour where p50 wanders between 15 and 40 ms and p99 is 100x p50 (1.5 to 4 s)."""
    p50: list[float | None] = [0.015 + 0.025 * (1 + math.sin(i / 20)) / 2 for i in range(360)]
    p99: list[float | None] = [100 * v for v in p50 if v is not None]
    return Window(slot_s=10, tokens_per_s=[5.0] * 360, ttft_p50_s=p50, ttft_p99_s=p99,
                  requests=3600, errors=0, tokens=18000, ttft_p50_all_s=0.027,
                  ttft_p99_all_s=2.7)  # fmt: skip


def test_a_lone_point_is_a_dot_not_a_dash() -> None:
    chart = line_chart("t", [("a", "series-a", [None, 0.5, None, 0.2, 0.4, None])],
                       fmt=str, x_labels=(), summary="", y_max=1.0)  # fmt: skip
    (line,) = chart.lines
    assert line.segments == ("3,80.00 4,60.00",)  # no polyline for the lone point
    assert line.dots == ((20.0, 50.0),)  # x 1 of 5 (20 %), y half way down
    assert chart.has_dots
    only = line_chart("t", [("a", "x", [0.3])], fmt=str, x_labels=(), summary="", y_max=1.0)
    assert only.lines[0].segments == () and only.lines[0].dots == ((0.0, 70.0),)


def test_ttft_p50_stays_readable_beside_p99_a_hundred_times_larger() -> None:
    _, latency = charts(spiky_window())
    p50 = ys(latency, "p50")
    # p50's swing from 15 to 40 ms spans 14 % of the plot's height (linear to 5 s: 0.5 %) ...
    assert (max(p50) - min(p50)) / HEIGHT > 0.1, (min(p50), max(p50))
    # ... and stays clear of the axis (linear: within 1 % of the bottom)
    assert (HEIGHT - max(p50)) / HEIGHT > 0.05
    decades = ("10.00 s", "1.00 s", "100 ms", "10 ms")
    assert latency.log and latency.y_labels == decades  # a label per power of ten
    assert len(latency.grid_ys) == 4 and min(ys(latency, "p99")) >= 0.0


def test_ttft_stays_linear_when_p99_is_within_ten_times_p50() -> None:
    window = spiky_window()
    p50 = [v for v in window.ttft_p50_s if v is not None]
    calm = Window(**{**window.__dict__, "ttft_p99_s": [2 * v for v in p50]})
    _, latency = charts(calm)
    assert not latency.log and latency.y_labels == ("100 ms", "50 ms", "0")


async def test_the_share_legend_lists_tenants_with_tokens_and_marks_suspended_ones(
    web: WebEnv,
) -> None:
    with web.store.db.session() as session:
        ids = {}
        for name in ("acme", "globex", "initech", "umbrella"):
            ids[name] = str(service.create_tenant(session, "admin", name).id)
        for name in ("globex", "initech"):
            tenant = service.get_tenant(session, name)
            assert tenant is not None
            service.update_tenant(session, "admin", tenant, status="suspended")
        gone = service.get_tenant(session, "umbrella")
        assert gone is not None
        service.delete_tenant(session, "admin", gone)
    clock = Clock()
    recorder = LiveRecorder(clock=clock)
    recorder.observe(0.1, 90, tenant=ids["acme"])
    recorder.observe(0.1, 30, tenant=ids["globex"])  # tokens, then suspended: shown, marked
    clock.now += 60
    recorder.observe(0.1, 0, tenant=ids["initech"])  # suspended, no token: not shown
    recorder.observe(None, 0, ok=False, tenant=ids["umbrella"])  # deleted, no token: not shown
    recorder.observe(0.1, 40, tenant="999")  # a deleted tenant with tokens: shown as such
    web.webui.recorder = web.webui.monitor.recorder = recorder
    async with web.http() as http:
        await sign_in(http)
        fragment = (await http.get("/admin/overview/charts")).text
    share = fragment[fragment.index("Share of generated tokens") :]
    legend = re.findall(r'class="legend-key [^"]+">([^<]+)<', share)
    assert legend == ["acme", "deleted tenant 999", "globex (suspended)"]
