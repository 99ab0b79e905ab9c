"""Single sign-on in headless Chromium against a real OpenID provider (Node's oidc-provider):
an operator signs in through the provider's form on the way to a page and creates a tenant;
a viewer signs in, reads the pages without any write form, has a form's POST refused (403,
nothing created) and signs out. Screenshots of the sign-in page and the viewer's page at
desktop and phone width (``screenshots/webui/``), checked for overflow by ``shot``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.platform import tenants
from loraplex.webui.oidc import OIDCClient
from tests.utils import browser as base
from tests.utils.oidc import needs_provider, provider, sso_settings
from tests.utils.server import ServerThread
from tests.utils.web import WebEnv

pytestmark = [base.needs_chromium, needs_provider]
expect = base.expect
browser = base.browser
shot = base.shot


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WebEnv, str]]:
    env = WebEnv.build(tmp_path)
    server = ServerThread(env.app)
    try:
        with provider([server.url + "/admin/sso/callback"]) as idp:
            env.webui.sso = OIDCClient(sso_settings(idp.issuer, server.url))
            with server:
                yield env, server.url
    finally:
        env.close()


def sso_sign_in(page: Any, url: str, login: str, next_path: str) -> None:
    page.goto(url + next_path)  # not signed in: the sign-in page, coming back here afterwards
    page.get_by_role("link", name="Sign in with Test IdP").click()
    page.locator("input[name=login]").fill(login)  # the provider's own form
    page.locator("input[name=password]").fill("any password")
    page.locator("button[type=submit]").click()
    page.wait_for_url(url + next_path)


def test_operator_and_viewer_sign_in_through_the_provider(
    browser: Any, served: tuple[WebEnv, str], shot: Any
) -> None:
    env, url = served
    operator = browser.new_context(viewport=base.DESKTOP)
    operator.set_default_timeout(10_000)
    page = operator.new_page()
    page.goto(url + "/admin/login")
    expect(page.get_by_role("link", name="Sign in with Test IdP")).to_be_visible()
    shot(page, "sso-login")
    sso_sign_in(page, url, "alice", "/admin/tenants")
    expect(page.locator("#signed-in-as")).to_have_text("alice · operator")
    expect(page.get_by_text("Signed in as alice (operator).")).to_be_visible()
    page.get_by_role("link", name="New tenant").click()
    page.locator("#f-name").fill("acme")
    page.get_by_role("button", name="Create tenant").click()
    expect(page.get_by_text("Tenant acme created.")).to_be_visible()
    operator.close()

    viewer = browser.new_context(viewport=base.DESKTOP)
    viewer.set_default_timeout(10_000)
    page = viewer.new_page()
    sso_sign_in(page, url, "bob", "/admin/tenants/acme")
    expect(page.locator("#signed-in-as")).to_have_text("bob · viewer")
    expect(page.locator("#read-only-notice")).to_be_visible()
    expect(page.get_by_role("heading", name="acme")).to_be_visible()
    page.goto(url + "/admin/tenants/-/new")
    expect(page.get_by_role("button", name="Create tenant")).to_be_hidden()  # no write form
    shot(page, "sso-viewer")
    # The form posted anyway (its CSRF token read from the hidden form): 403, nothing made.
    token = page.locator("main input[name=csrf_token]").first.get_attribute("value")
    refused = page.request.post(
        url + "/admin/tenants",
        form={"csrf_token": token, "name": "evil", "display_name": ""},
        max_redirects=0,
    )
    assert refused.status == 403 and "viewer role" in refused.text()
    api = page.request.post(url + "/admin/api/tenants", data={"name": "evil"})
    assert api.status == 403 and api.json()["error"]["code"] == "read_only_role"
    with env.store.db.session() as session:
        assert tenants.get_tenant(session, "evil") is None
    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_text("You have signed out.")).to_be_visible()
    page.goto(url + "/admin/tenants")
    expect(page.get_by_role("link", name="Sign in with Test IdP")).to_be_visible()
    viewer.close()
