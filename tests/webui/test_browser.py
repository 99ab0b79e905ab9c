"""The admin UI in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright.

A uvicorn server in a thread serves the app on the fake engine; the test signs in, watches the
live numbers follow the engine (and the engine going down and back), signs out, and takes a
screenshot of each page at 1280×800 and at phone width (390×844) into ``screenshots/webui/`` (git
ignored; ``LORAPLEX_SCREENSHOTS`` picks another folder). On every page and at both sizes it checks
that nothing overflows horizontally.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.webui.live import LiveRecorder
from tests.utils import browser as base
from tests.utils.server import ServerThread
from tests.utils.web import ADMIN_TOKEN, WebEnv

pytestmark = base.needs_chromium
expect = base.expect
DESKTOP, PHONE = base.DESKTOP, base.PHONE

# The browser and the screenshot helper every browser test shares.
browser = base.browser
shot = base.shot


def backfill(env: WebEnv, minutes: int = 60) -> None:
    """An hour of made-up traffic (with a quiet spell), so the charts have something to draw."""
    offset = [-minutes * 60.0]

    def clock() -> float:
        return time.monotonic() + offset[0]

    recorder = LiveRecorder(clock=clock)
    rng = random.Random(7)
    step = 0
    while offset[0] < 0:
        if not 150 <= step < 180:  # five quiet minutes
            load = 4 + 3 * (1 + (step % 90) / 90)
            for _ in range(rng.randint(int(load), int(load) + 4)):
                recorder.observe(rng.lognormvariate(-2.3 + step / 2000, 0.45), rng.randint(40, 160))
        offset[0] += 10.0
        step += 1
    offset[0] = 0.0
    env.webui.recorder = env.webui.monitor.recorder = recorder


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WebEnv, str]]:
    env = WebEnv.build(tmp_path, refresh_seconds=0.5)
    backfill(env)
    try:
        with ServerThread(env.app) as server:
            yield env, server.url
    finally:
        env.close()


def test_sign_in_watch_the_engine_sign_out(
    browser: Any, served: tuple[WebEnv, str], shot: base.Shot
) -> None:
    env, url = served
    page = browser.new_page(viewport=DESKTOP)
    errors: list[str] = []
    # Script errors only: "Failed to load resource" is the browser noting the 401/403 pages.
    page.on(
        "console",
        lambda m: (
            errors.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.on("pageerror", lambda e: errors.append(str(e)))

    page.goto(url + "/admin")
    expect(page).to_have_url(re.compile(r"/admin/login\?next=%2Fadmin$"))
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    shot(page, "login")

    page.get_by_label("Admin token").fill("not-the-token-0123456789")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#login-error")).to_contain_text("not the admin token")
    shot(page, "login-error")

    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(re.compile(r"/admin$"))
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    running = page.locator('[data-live="running"]')
    expect(running).to_have_text("3")
    expect(page.locator("nav a[aria-current=page]")).to_have_text("Overview")

    # The numbers follow the engine without a reload.
    env.fake.engine_stats.update(num_running=7, num_waiting=2, kv_cache_usage=0.62)
    expect(running).to_have_text("7", timeout=5000)
    expect(page.locator('[data-live="kv_usage"]')).to_have_text("62.0%")
    expect(page.locator("[data-live-updated]")).to_contain_text("Updated")
    assert page.locator("meter[data-live-meter]").evaluate("m => m.value") == pytest.approx(0.62)
    assert page.locator(".chart polyline").count() >= 3  # throughput + p50 + p99, gaps split them
    shot(page, "overview")

    # The engine goes down and comes back: a state on the page, never an error page.
    env.fake.alive = False
    banner = page.locator("[data-live-down]")
    expect(banner).to_be_visible(timeout=5000)
    expect(page.locator('[data-live="status"]')).to_have_text("down")
    shot(page, "overview-engine-down")
    env.fake.alive = True
    expect(banner).to_be_hidden(timeout=5000)
    expect(page.locator('[data-live="status"]')).to_have_text("running")

    # A form whose CSRF token was tampered with is refused with a page that says so.
    page.locator("form.signout input[name=csrf_token]").evaluate("i => i.value = 'forged'")
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="This form was refused")).to_be_visible()
    shot(page, "refused")

    page.goto(url + "/admin")
    page.get_by_role("button", name="Sign out").click()
    expect(page).to_have_url(re.compile(r"/admin/login\?notice=signed_out$"))
    expect(page.get_by_text("You have signed out.")).to_be_visible()
    page.goto(url + "/admin")
    expect(page).to_have_url(re.compile(r"/admin/login"))
    assert errors == [], errors


def test_the_pages_work_without_javascript(browser: Any, served: tuple[WebEnv, str]) -> None:
    _, url = served
    context = browser.new_context(java_script_enabled=False, viewport=PHONE)
    page = context.new_page()
    page.goto(url + "/admin")
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator('[data-live="running"]')).to_have_text("3")
    expect(page.locator(".chart svg")).to_have_count(3)  # throughput, TTFT, tenant shares
    cookies = {c["name"]: c for c in context.cookies()}
    session = cookies["lpx_admin_session"]
    assert session["httpOnly"] and session["sameSite"] == "Strict" and session["path"] == "/admin"
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_text("You have signed out.")).to_be_visible()
    context.close()
