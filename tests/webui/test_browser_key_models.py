"""A key limited to models, in headless Chromium (issue 34.3): the key form's Models field (a bad
list first, shown inline), the Models column, the key's Edit page; the API follows each change
from the key's next request. Screenshots at desktop and phone width (``screenshots/webui/``),
each checked for horizontal overflow."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.platform import tenants as service
from tests.utils import browser as base
from tests.utils.server import ServerThread
from tests.utils.tenancy import bearer
from tests.utils.web import ADMIN_TOKEN, WebEnv

pytestmark = base.needs_chromium
expect = base.expect
browser = base.browser
shot = base.shot

KEY = re.compile(r"lpx_[a-z0-9]{12}_[A-Za-z0-9]{32}")
BASE = "tiny-model"  # WebEnv's fake engine serves the base model under this name


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WebEnv, str]]:
    env = WebEnv.build(tmp_path)
    with env.store.db.session() as session:
        service.create_tenant(session, "admin", "acme")
    try:
        with ServerThread(env.app) as server:
            yield env, server.url
    finally:
        env.close()


def models_of(url: str, token: str) -> list[str]:
    r = httpx.get(url + "/v1/models", headers=bearer(token), timeout=10)
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


def test_a_key_limited_to_models_in_the_browser(
    browser: Any, served: tuple[WebEnv, str], shot: Any
) -> None:
    _, url = served
    page = browser.new_context(viewport=base.DESKTOP).new_page()
    page.set_default_timeout(10_000)
    page.goto(url + "/admin/keys/new?tenant=acme")
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="New API key")).to_be_visible()

    page.get_by_label("Key name").fill("pirate only")
    page.get_by_label("Models", exact=True).fill("pirate, not a name")
    page.get_by_role("button", name="Create key").click()
    expect(page.locator("#f-allowed_models-help")).to_contain_text("without spaces")
    expect(page.get_by_label("Models", exact=True)).to_have_value("pirate, not a name")
    shot(page, "key-new-models-error")
    page.get_by_label("Models", exact=True).fill("pirate, caps@1")
    page.get_by_role("button", name="Create key").click()
    token = page.locator("#new-key").inner_text().strip()
    assert KEY.fullmatch(token), token
    assert models_of(url, token) == []  # neither adapter exists, and the base is not listed

    page.goto(url + "/admin/tenants/acme")
    expect(page.get_by_role("cell", name="pirate, caps@1")).to_be_visible()
    shot(page, "tenant-key-models")
    page.get_by_role("link", name=re.compile(r"^Edit lpx_")).click()
    expect(page.get_by_label("Models", exact=True)).to_have_value("pirate, caps@1")
    page.get_by_label("Models", exact=True).fill(BASE)
    shot(page, "key-edit")
    page.get_by_role("button", name="Save").click()
    expect(page).to_have_url(re.compile(r"/admin/tenants/acme$"))
    expect(page.get_by_text(f"models {BASE}, from its next request")).to_be_visible()
    assert models_of(url, token) == [BASE]

    page.goto(url + "/admin/keys")
    expect(page.get_by_role("cell", name=BASE, exact=True)).to_be_visible()
    page.get_by_role("link", name=re.compile(r"^Edit lpx_")).click()
    page.get_by_label("Models", exact=True).fill("")
    page.get_by_role("button", name="Save").click()
    expect(page.get_by_text("models all models, from its next request")).to_be_visible()
    assert models_of(url, token) == [BASE]  # every model: the tenant has no adapters
