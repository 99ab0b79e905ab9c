"""The Requests page in headless Chromium (issue 34.4): filter the request log by status
class with the form, open a failed request and read its stored bodies. Screenshots at desktop
and phone width (``screenshots/webui/``), each checked for horizontal overflow."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.utils import browser as base
from tests.utils.request_logs import add_log_rows
from tests.utils.server import ServerThread
from tests.utils.web import ADMIN_TOKEN, WebEnv

pytestmark = base.needs_chromium
expect = base.expect
browser = base.browser
shot = base.shot


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WebEnv, str]]:
    """The admin UI over HTTP with 8 answered requests of acme and 2 failed ones of beta."""
    env = WebEnv.build(tmp_path)
    add_log_rows(env, "acme", 8)
    add_log_rows(env, "beta", 2, status=503, request_body='{"prompt": "hello"}',
              response_body='{"error": "engine down", "detail": "' + "x" * 400 + '"}')  # fmt: skip
    try:
        with ServerThread(env.app) as server:
            yield env, server.url
    finally:
        env.close()


def test_requests_in_the_browser(browser: Any, served: tuple[WebEnv, str], shot: Any) -> None:
    _, url = served
    page = browser.new_context(viewport=base.DESKTOP).new_page()
    page.set_default_timeout(10_000)
    page.goto(url + "/admin/requests")
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Requests", exact=True)).to_be_visible()
    expect(page.locator("a.request-link")).to_have_count(10)
    shot(page, "requests")

    page.get_by_label("Status").select_option("5xx")
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(r"status=5xx"))
    expect(page.locator("a.request-link")).to_have_count(2)
    page.get_by_role("link", name="beta-503-0").click()
    expect(page.get_by_role("heading", name="Request beta-503-0")).to_be_visible()
    expect(page.locator("pre.body-text").first).to_have_text('{"prompt": "hello"}')
    expect(page.locator("pre.body-text").nth(1)).to_contain_text("engine down")
    shot(page, "request")
