"""The Overview's charts and the tenant pickers in a real browser at 1400 px (issue 35.4):
a lone minute of the share chart is a round dot, TTFT p50 keeps a visible height beside a p99
a hundred times larger, and the new-key form's tenant field is a select that submits the
chosen tenant. Geometry in test_charts.py; the viewer's pickers in test_tenant_picker.py."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.platform import tenants as service
from loraplex.webui.live import LiveRecorder
from tests.utils import browser as base
from tests.utils.server import ServerThread
from tests.utils.web import ADMIN_TOKEN, WebEnv

pytestmark = base.needs_chromium
expect = base.expect
WIDE = {"width": 1400, "height": 900}

browser = base.browser
shot = base.shot


def sparse_hour(env: WebEnv, acme: str, globex: str) -> None:
    """An hour of requests: TTFT every 10 s (p50 15 to 40 ms, p99 100x p50) generating no token,
    and tokens in minutes 10 (acme alone), 20 to 25 (both) and 40 (globex alone) only, so
    minutes 10 and 40 are lone points of the share chart."""
    now = 1_000_000.0  # a still clock: the minutes stay where they are while the page loads
    offset = [-3590.0]  # the window's first slot
    recorder = LiveRecorder(clock=lambda: now + offset[0])
    for step in range(360):
        p50 = 0.015 + 0.025 * (1 + math.sin(step / 20)) / 2
        for i in range(100):  # 98 at p50, 2 at 100x: p99 is the spike
            recorder.observe(p50 * (100 if i < 2 else 1), 0)
        minute = step // 6
        if minute == 10 or 20 <= minute <= 25:
            recorder.observe(0.02, 60, tenant=acme)
        if minute == 40 or 20 <= minute <= 25:
            recorder.observe(0.02, 30, tenant=globex)
        offset[0] = min(0.0, offset[0] + 10.0)
    env.webui.recorder = env.webui.monitor.recorder = recorder


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WebEnv, str]]:
    env = WebEnv.build(tmp_path, refresh_seconds=30)
    with env.store.db.session() as session:
        acme = service.create_tenant(session, "admin", "acme")
        globex = service.create_tenant(session, "admin", "globex")
        service.update_tenant(session, "admin", globex, status="suspended")
        ids = str(acme.id), str(globex.id)
    sparse_hour(env, *ids)
    try:
        with ServerThread(env.app) as server:
            yield env, server.url
    finally:
        env.close()


def sign_in(page: Any, url: str, path: str) -> None:
    page.goto(url + path)
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(re.compile(re.escape(path) + "$"))


def test_lone_minutes_are_dots_and_p50_stays_visible_beside_p99(
    browser: Any, served: tuple[WebEnv, str], shot: base.Shot
) -> None:
    _, url = served
    page = browser.new_page(viewport=WIDE)
    sign_in(page, url, "/admin")
    share = page.locator("figure.chart", has_text="Share of generated tokens")
    plot = share.locator(".plot svg").first.bounding_box()
    dots = share.locator("circle.dot")
    expect(dots).to_have_count(4)  # minutes 10 and 40, a dot for each tenant's line
    for i in range(4):
        box = dots.nth(i).bounding_box()
        assert box["width"] >= 6 and box["height"] >= 6, box  # a point, not a dash
        assert abs(box["width"] - box["height"]) < 0.5, box  # round at any width
        middle_x, middle_y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        assert plot["x"] <= middle_x <= plot["x"] + plot["width"]
        assert plot["y"] <= middle_y <= plot["y"] + plot["height"]

    ttft = page.locator("figure.chart", has_text="Time to first token")
    svg = ttft.locator(".plot svg").first.bounding_box()
    p50 = [b for b in ttft.locator("polyline.series-a").evaluate_all(
        "ls => ls.map(l => { const r = l.getBoundingClientRect(); return [r.top, r.bottom]; })"
    )]  # fmt: skip
    top, bottom = min(t for t, _ in p50), max(b for _, b in p50)
    # The p50 line spans a visible height (linear: about 1 px of 160) above the axis.
    assert bottom - top >= 0.1 * svg["height"], (top, bottom, svg)
    assert svg["y"] + svg["height"] - bottom >= 0.05 * svg["height"]
    expect(ttft.locator(".chart-scale")).to_have_text("(log scale)")
    # No line for the operator (its requests generated no token); globex marked suspended.
    expect(share.locator(".legend-key")).to_have_text(["acme", "globex (suspended)"])
    shot(page, "overview-charts")
    page.close()


def test_the_key_form_picks_the_tenant_from_a_list(
    browser: Any, served: tuple[WebEnv, str], shot: base.Shot
) -> None:
    env, url = served
    page = browser.new_page(viewport=WIDE)
    sign_in(page, url, "/admin/keys/new")
    tenant = page.get_by_label("Tenant")
    assert tenant.evaluate("e => e.tagName") == "SELECT"
    expect(tenant.locator("option")).to_have_text(
        ["Choose a tenant…", "acme", "globex (suspended)"]
    )
    page.get_by_role("button", name="Create key").click()  # nothing chosen: the browser asks
    assert tenant.evaluate("e => e.validity.valueMissing")
    expect(page).to_have_url(re.compile("/admin/keys/new$"))
    tenant.select_option("acme")
    page.get_by_label("Key name").fill("picked")
    shot(page, "keys-new-picker")
    page.get_by_role("button", name="Create key").click()
    expect(page).to_have_url(re.compile(r"/admin/keys/[^/]+/created$"))
    expect(page.get_by_text("acme").first).to_be_visible()
    with env.store.db.session() as session:
        acme = service.get_tenant(session, "acme")
        assert acme is not None
        assert [k.name for k in service.list_keys(session, acme)] == ["picked"]

    page.goto(url + "/admin/adapters/upload?tenant=globex")
    expect(page.get_by_label("Tenant")).to_have_value("globex")  # preselected from the link
    page.goto(url + "/admin/playground")
    picker = page.get_by_label("Tenant")
    expect(picker.locator("option")).to_have_text(
        ["None: the server's own models", "acme", "globex (suspended)"]
    )
    picker.select_option("acme")
    page.get_by_role("button", name="Load adapters").click()
    expect(page).to_have_url(re.compile(r"/admin/playground\?tenant=acme$"))
    expect(page.get_by_label("Tenant")).to_have_value("acme")
    button = page.get_by_role("button", name="Load adapters").bounding_box()
    select = page.get_by_label("Tenant").bounding_box()
    assert abs(button["y"] - select["y"]) < 8 and button["x"] > select["x"] + select["width"]
    shot(page, "playground-picker")
    page.close()
