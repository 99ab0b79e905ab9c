"""The tenant field of the new-key, upload and playground forms (issue 35.4): a select of the
tenants the signed-in user may act for (an operator: every tenant, a suspended one marked; a
viewer: none), a text field with suggestions past ``PICKER_LIMIT`` tenants, and the server's
check of the posted name unchanged. The browser's pick-and-submit is in test_browser_charts.py."""

from __future__ import annotations

import re

import httpx
import pytest
from sqlalchemy import select

from loraplex.platform import tenants as service
from loraplex.platform.db.models import ApiKey
from loraplex.webui import tenant_picker
from tests.utils.oidc import needs_provider, sso_sign_in
from tests.utils.web import WebEnv, csrf_of, post_form, sign_in

pytestmark = pytest.mark.anyio

FORMS = ("/admin/keys/new", "/admin/adapters/upload", "/admin/playground")
_SELECT = re.compile(
    r'<select id="(f-tenant|f-pick-tenant)" name="tenant"[^>]*>(.*?)</select>', re.S
)
_OPTION = re.compile(r'<option value="([^"]*)"[^>]*>([^<]*)</option>')


def tenant_options(html: str) -> list[tuple[str, str]] | None:
    """The (value, label) options of the page's tenant select; None when it has no select."""
    match = _SELECT.search(html)
    return _OPTION.findall(match.group(2)) if match else None


def seed(env: WebEnv) -> None:
    with env.store.db.session() as session:
        service.create_tenant(session, "admin", "globex")
        service.create_tenant(session, "admin", "acme")
        globex = service.get_tenant(session, "globex")
        assert globex is not None
        service.update_tenant(session, "admin", globex, status="suspended")


def key_tenants(env: WebEnv) -> list[str]:
    with env.store.db.session() as session:
        return [k.tenant.name for k in session.scalars(select(ApiKey))]


async def test_an_operator_picks_from_every_tenant(web: WebEnv) -> None:
    seed(web)
    async with web.http() as http:
        await sign_in(http)
        for path in FORMS:
            page = await http.get(path, params={"tenant": "acme"})
            assert page.status_code == 200, (path, page.text[:300])
            options = tenant_options(page.text)
            assert options is not None, path  # a select, not free text
            assert options[1:] == [("acme", "acme"), ("globex", "globex (suspended)")], path
            assert '<option value="acme" selected>' in page.text, path
        # The server checks the posted name as before: a name from no list is refused.
        r = await post_form(http, "/admin/keys/new", "/admin/keys",
                            {"tenant": "ghost", "scopes": "inference"})  # fmt: skip
        assert r.status_code == 404 and "There is no tenant named &#39;ghost&#39;" in r.text
        assert tenant_options(r.text)[:2] == [("", "Choose a tenant…"), ("ghost", "ghost")]  # type: ignore[index]
        r = await post_form(http, "/admin/keys/new", "/admin/keys",
                            {"tenant": "acme", "scopes": "inference"})  # fmt: skip
        assert r.status_code == 303
    assert key_tenants(web) == ["acme"]


async def test_past_the_limit_the_field_is_text_with_suggestions(
    web: WebEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(web)
    monkeypatch.setattr(tenant_picker, "PICKER_LIMIT", 1)  # more tenants than a select lists
    async with web.http() as http:
        await sign_in(http)
        page = await http.get("/admin/keys/new")
        assert tenant_options(page.text) is None
        assert 'name="tenant" required' in page.text and 'list="f-tenant-names"' in page.text
        assert re.findall(r'<datalist id="f-tenant-names">(.*?)</datalist>', page.text) == [
            '<option value="acme">'
        ]
        r = await post_form(http, "/admin/keys/new", "/admin/keys",
                            {"tenant": "globex", "scopes": "inference"})  # fmt: skip
        assert r.status_code == 303  # a tenant past the suggestions, typed
    assert key_tenants(web) == ["globex"]


@needs_provider
async def test_a_viewer_acts_for_no_tenant(sso_web: WebEnv, sso_http: httpx.AsyncClient) -> None:
    seed(sso_web)
    assert (await sso_sign_in(sso_http, "bob")).status_code == 303  # bob: a viewer
    for path in FORMS:
        page = await sso_http.get(path)
        assert page.status_code == 200, path
        options = tenant_options(page.text)
        assert options is not None and len(options) == 1 and options[0][0] == "", (path, options)
        assert "globex" not in page.text and "acme" not in page.text, path
    page = await sso_http.get("/admin/keys/new")
    r = await sso_http.post("/admin/keys", data={"csrf_token": csrf_of(page.text), "tenant": "acme",
                                             "scopes": "inference"})  # fmt: skip
    assert r.status_code == 403 and "viewer role" in r.text
    assert key_tenants(sso_web) == []
