"""The Overview's numbers: the hour recorder, TTFT percentiles, token rates and the charts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loraplex.platform.request_log import RequestRecord
from loraplex.webui.charts import line_chart, nice_ceiling
from loraplex.webui.live import (
    OTHERS,
    CounterRate,
    EngineMonitor,
    LatencyHistogram,
    LiveRecorder,
    format_seconds,
)
from loraplex.webui.overview import share_chart
from tests.utils.fakes import FakeEngineClient

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self, now: float = 100_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_ttft_percentiles_are_within_four_percent() -> None:
    rng = random.Random(0)
    samples = [rng.lognormvariate(-2.0, 1.0) for _ in range(5000)]
    histogram = LatencyHistogram()
    for s in samples:
        histogram.add(s)
    ordered = sorted(samples)
    for q in (0.5, 0.9, 0.99):
        exact = ordered[int(q * len(ordered)) - 1]
        estimate = histogram.quantile(q)
        assert estimate is not None
        assert abs(estimate - exact) / exact < 0.05, (q, estimate, exact)
    assert LatencyHistogram().quantile(0.5) is None


def test_the_window_is_the_last_hour_in_ten_second_slots() -> None:
    clock = Clock()
    recorder = LiveRecorder(clock=clock)
    window = recorder.window()
    assert len(window.tokens_per_s) == 360
    assert window.tokens_per_s[:-1] == [None] * 359  # before the recorder started: no data
    for _ in range(3):
        recorder.observe(0.2, 50)
    clock.now += 10
    recorder.observe(0.4, 100, ok=False)
    clock.now += 5
    window = recorder.window()
    assert window.tokens_per_s[-2] == pytest.approx(15.0)  # 150 tokens in a full slot
    assert window.tokens_per_s[-1] == pytest.approx(100 / 5)  # the slot in progress: 5 s so far
    assert window.ttft_p50_s[-2] == pytest.approx(0.2, rel=0.05)
    assert window.ttft_p99_s[-1] == pytest.approx(0.4, rel=0.05)
    assert (window.requests, window.errors, window.tokens) == (4, 1, 250)
    clock.now += 3600  # an hour later everything has slid out
    window = recorder.window()
    assert window.requests == 0 and window.ttft_p50_all_s is None
    assert window.tokens_per_s[-1] == 0.0 and window.ttft_p50_s[-1] is None


def test_old_slots_are_dropped_as_time_moves_on() -> None:
    clock = Clock()
    recorder = LiveRecorder(clock=clock)
    for _ in range(2000):
        recorder.observe(0.1, 1)
        clock.now += 10
    assert len(recorder._data) <= 360


def test_only_completion_requests_that_ran_are_recorded() -> None:
    recorder = LiveRecorder(clock=Clock())
    ran = RequestRecord("POST", "/v1/chat/completions", start=10.0)
    ran.generated, ran.first_token_time, ran.completion_tokens, ran.status = True, 10.25, 7, 200
    refused = RequestRecord("POST", "/v1/completions", status=429)
    elsewhere = RequestRecord("GET", "/v1/models", status=200)
    for record in (ran, refused, elsewhere):
        recorder.observe_record(record)
    window = recorder.window()
    assert (window.requests, window.tokens) == (1, 7)
    assert window.ttft_p50_all_s == pytest.approx(0.25, rel=0.05)


def test_counter_rate_follows_the_engine_and_survives_a_restart() -> None:
    clock = Clock()
    rate = CounterRate(window_s=10, clock=clock)
    assert rate.update(1000) is None
    clock.now += 2
    assert rate.update(1100) == pytest.approx(50)
    clock.now += 2
    assert rate.update(1300) == pytest.approx(75)
    clock.now += 2
    assert rate.update(20) is None  # the counter went down: the engine restarted
    clock.now += 2
    assert rate.update(60) == pytest.approx(20)


async def test_monitor_reads_tokens_per_second_from_the_engine_counter() -> None:
    clock = Clock()
    fake = FakeEngineClient(model_dir="m")
    monitor = EngineMonitor(fake, LiveRecorder(clock=clock))
    monitor.rate = CounterRate(clock=clock)
    fake.engine_stats["num_generated_tokens"] = 500
    assert (await monitor.read()).tokens_per_s == 0.0  # first reading: the recorder's (idle)
    clock.now += 4
    fake.engine_stats["num_generated_tokens"] = 900
    view = await monitor.read()
    assert view.up and view.tokens_per_s == pytest.approx(100)
    assert view.display()["tokens_per_s"] == "100"
    fake.alive = False
    view = await monitor.read()
    assert not view.up and view.error and view.display()["running"] == "—"


def test_chart_geometry_breaks_at_gaps_and_scales_to_a_nice_maximum() -> None:
    chart = line_chart(
        "t",
        [("a", "series-a", [None, 1.0, 3.0, None, 2.0, None])],
        fmt=lambda v: f"{v:g}",
        x_labels=("then", "now"),
        summary="s",
    )
    assert chart.width == 5 and chart.y_labels == ("5", "2.5", "0")
    (line,) = chart.lines
    assert line.segments == ("1,80.00 2,40.00",)
    assert line.dots == ((80.0, 60.0),)  # the lone point: a dot at 80% across, 60% down
    assert not chart.empty
    assert line_chart("t", [("a", "x", [None, None])], fmt=str, x_labels=(), summary="").empty
    assert [nice_ceiling(v) for v in (0, 0.3, 1, 1.2, 2.2, 4, 7, 180)] == [
        1, 0.5, 1, 2, 2.5, 5, 10, 200,
    ]  # fmt: skip
    assert format_seconds(0.0123) == "12 ms" and format_seconds(2.5) == "2.50 s"


def test_the_charts_recorder_sees_every_request(tmp_path: Path) -> None:
    """The composition root lists the UI's recorder among the request log's observers."""
    from loraplex.platform.request_log import RequestLogMiddleware
    from loraplex.platform.settings import ServerSettings
    from loraplex.server import create_app
    from tests.utils.tenancy import platform_for

    store = platform_for(tmp_path)
    try:
        app = create_app(FakeEngineClient(model_dir="m"), ServerSettings(), store=store)
        assert app.webui is not None
        (log,) = [m for m in app.user_middleware if m.cls is RequestLogMiddleware]
        observers = log.kwargs["observers"]
        assert app.webui.recorder.observe_record in observers
        assert app.platform.metrics.observe in observers
    finally:
        store.db.dispose()


def test_tenant_shares_per_minute_with_the_top_tenants_and_the_rest() -> None:
    clock = Clock()
    recorder = LiveRecorder(clock=clock)
    for minute in range(10):
        for _ in range(3):
            recorder.observe(0.1, 30, tenant="1")  # 90 tokens a minute
        recorder.observe(0.1, 10, tenant="2")  # 10
        if minute >= 5:
            recorder.observe(0.1, 100, tenant="3")  # 100, the last five minutes only
        clock.now += 60
    recorder.observe(0.1, 5, tenant=None)  # the operator
    shares = recorder.tenant_shares(top=2)
    assert shares.point_s == 60 and len(shares.shares["1"]) == 60
    assert shares.totals == {"1": 900, "3": 500, OTHERS: 105}  # tenant 2 and the operator
    assert set(shares.shares) == {"1", "3", OTHERS}
    # A point per minute; before the recorder ran: None, not 0.
    first = 60 - 11
    assert all(v is None for v in shares.shares["1"][:first])
    assert shares.shares["1"][first : first + 5] == [pytest.approx(0.9)] * 5
    assert shares.shares["3"][first + 5 : first + 10] == [pytest.approx(0.5)] * 5
    assert shares.shares[OTHERS][first + 5 : first + 10] == [pytest.approx(0.05)] * 5
    assert shares.shares[OTHERS][-1] == 1.0  # only the operator in the last minute
    for i in range(first, 60):  # every point sums to one
        assert sum(shares.shares[k][i] or 0 for k in shares.shares) == pytest.approx(1.0)

    chart = share_chart(shares, {"1": "acme", "3": "globex"})
    assert [line.label for line in chart.lines] == ["acme", "globex", "other tenants"]
    assert chart.y_labels == ("100%", "50%", "0")
    assert "acme 60%, globex 33%, other tenants 7% of 1,505 tokens" in chart.summary


def test_the_recorder_takes_the_tenant_from_the_request_record() -> None:
    recorder = LiveRecorder()
    record = RequestRecord(method="POST", path="/v1/completions", tenant_id="7")
    record.generated, record.completion_tokens = True, 12
    recorder.observe_record(record)
    assert recorder.tenant_shares().totals == {"7": 12}
