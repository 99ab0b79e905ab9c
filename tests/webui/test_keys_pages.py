"""The Keys pages: create (the secret shown exactly once), list, revoke after a confirmation,
and a key revoked in the UI is refused by the API on its very next request."""

from __future__ import annotations

import datetime as dt
import re

import httpx
import pytest
from sqlalchemy import func, select

from loraplex.platform import tenants as service
from loraplex.platform.db.models import ApiKey, AuditEvent, utcnow
from loraplex.platform.keys import display_key, parse_key
from loraplex.webui.sessions import OneTimeSecrets
from loraplex.webui.sessions import Session as WebSession
from loraplex.webui.views import WEB_ACTOR
from tests.utils.tenancy import bearer
from tests.utils.web import WebEnv, post_form, sign_in

pytestmark = pytest.mark.anyio

KEY = re.compile(r"lpx_[a-z0-9]{12}_[A-Za-z0-9]{32}")


def make_tenant(web: WebEnv, name: str) -> None:
    with web.store.db.session() as session:
        service.create_tenant(session, "admin", name)


def key_row(web: WebEnv, public_id: str) -> ApiKey:
    with web.store.db.session() as session:
        row = session.scalars(select(ApiKey).where(ApiKey.public_id == public_id)).one()
        session.expunge(row)
        return row


def key_count(web: WebEnv) -> int:
    with web.store.db.session() as session:
        return session.scalar(select(func.count()).select_from(ApiKey)) or 0


async def new_key(http: httpx.AsyncClient, **fields: str | list[str]) -> httpx.Response:
    data: dict[str, str | list[str]] = {"scopes": ["inference", "adapters:write"], **fields}
    return await post_form(http, "/admin/keys/new", "/admin/keys", data)  # type: ignore[arg-type]


async def test_a_new_key_is_shown_once_and_works_until_revoked(web: WebEnv) -> None:
    make_tenant(web, "acme")
    async with web.http() as http:
        await sign_in(http)
        form = await http.get("/admin/keys/new", params={"tenant": "acme"})
        assert '<option value="acme" selected>acme</option>' in form.text  # the tenant picker
        assert form.text.count('type="checkbox" name="scopes"') == 2
        assert form.text.count(" checked>") == 2  # both scopes by default

        response = await new_key(http, tenant="acme", name="production", expires_days="30")
        assert response.status_code == 303
        created_url = response.headers["location"]
        public_id = created_url.split("/")[3]
        assert created_url == f"/admin/keys/{public_id}/created"

        shown = await http.get(created_url)
        tokens = KEY.findall(shown.text)
        assert len(set(tokens)) == 1, "the whole key appears on the page"
        token = tokens[0]
        assert parse_key(token) == (public_id, token.rsplit("_", 1)[1])
        assert '<code id="new-key" class="secret-value">' + token in shown.text
        assert '<button type="button" class="button subtle copy" data-copy="new-key" hidden>' in (
            shown.text
        )  # revealed by admin.js where the clipboard API exists
        assert shown.headers["cache-control"] == "no-store"

        # Reloading shows the key's facts, never its secret again.
        again = await http.get(created_url)
        assert again.status_code == 200
        assert KEY.search(again.text) is None and token not in again.text
        assert "cannot be shown again" in again.text
        assert display_key(public_id, token[-4:]) in again.text

        # The key works; revoked in the UI, it is refused on the very next request.
        assert (await http.get("/v1/models", headers=bearer(token))).status_code == 200
        confirm = await http.get(f"/admin/keys/{public_id}/revoke")
        assert "Revoke this key?" in confirm.text and display_key(public_id, token[-4:]) in (
            confirm.text
        )
        revoked = await post_form(
            http, f"/admin/keys/{public_id}/revoke", f"/admin/keys/{public_id}/revoke", {}
        )
        assert revoked.headers["location"] == "/admin/tenants/acme"
        refused = await http.get("/v1/models", headers=bearer(token))
        assert refused.status_code == 401
        assert "revoked" in refused.json()["error"]["message"]
        page = await http.get("/admin/tenants/acme")
        assert "revoked: it is refused from its next request" in page.text
        assert "badge-danger" in page.text and "Revoke…" not in page.text

    row = key_row(web, public_id)
    assert row.name == "production" and row.scopes == ["inference", "adapters:write"]
    assert row.revoked_at is not None and row.expires_at is not None
    assert abs(row.expires_at - (utcnow() + dt.timedelta(days=30))) < dt.timedelta(minutes=1)
    with web.store.db.session() as session:
        assert token not in repr(session.execute(select(ApiKey.__table__)).all())


async def test_another_session_never_sees_the_secret(web: WebEnv) -> None:
    make_tenant(web, "acme")
    async with web.http() as http, web.http() as other:
        await sign_in(http)
        await sign_in(other)
        response = await new_key(http, tenant="acme")
        page = await other.get(response.headers["location"])
        assert page.status_code == 200 and KEY.search(page.text) is None
        assert KEY.search((await http.get(response.headers["location"])).text) is not None


@pytest.mark.parametrize(
    ("fields", "field", "message", "status"),
    [
        ({"tenant": "", "scopes": ["inference"]}, "tenant", "Enter the name of the tenant", 400),
        ({"tenant": "nobody", "scopes": ["inference"]}, "tenant", "no tenant named", 404),
        ({"tenant": "acme", "scopes": []}, "scopes", "Tick at least one scope", 400),
        ({"tenant": "acme", "scopes": ["admin"]}, "scopes", "Key scopes are a non-empty", 400),
        ({"tenant": "acme", "expires_days": "0"}, "expires_days", "whole number of days", 400),
        ({"tenant": "acme", "expires_days": "9999"}, "expires_days", "from 1 to 3,650", 400),
        ({"tenant": "acme", "name": "x" * 101}, "name", "at most 100 characters", 400),
        ({"tenant": "acme", "allowed_models": "a b"}, "allowed_models", "without spaces", 400),
    ],
)
async def test_a_bad_key_form_comes_back_with_the_message_inline(
    web: WebEnv, fields: dict[str, str | list[str]], field: str, message: str, status: int
) -> None:
    make_tenant(web, "acme")
    async with web.http() as http:
        await sign_in(http)
        response = await new_key(http, **fields)
        assert response.status_code == status
        error = re.search(rf'<p class="field-error" id="f-{field}-help">([^<]*)</p>', response.text)
        assert error and message.lower() in error.group(1).lower(), response.text
    assert key_count(web) == 0


async def test_the_keys_list_filters_and_pages(web: WebEnv) -> None:
    make_tenant(web, "acme")
    make_tenant(web, "beta")
    with web.store.db.session() as session:
        acme, beta = (
            service.require_tenant(session, "acme"),
            service.require_tenant(session, "beta"),
        )
        made = [service.create_key(session, "admin", acme, name=f"k{i}")[1] for i in range(55)]
        old = service.create_key(
            session, "admin", beta, expires_at=utcnow() - dt.timedelta(days=1)
        )[1]
        service.revoke_key(session, "admin", acme, made[0].public_id)
    async with web.http() as http:
        await sign_in(http)
        page = await http.get("/admin/keys")
        assert page.text.count('<code class="key">') == 50
        assert KEY.search(page.text) is None  # prefix…last4 only
        assert display_key(old.public_id, old.last4) in page.text  # newest first
        older = re.search(r'href="(/admin/keys\?before=\d+)" rel="next"', page.text)
        assert older
        rest = await http.get(older.group(1))
        assert rest.text.count('<code class="key">') == 6 and "« Newest" in rest.text
        assert display_key(made[0].public_id, made[0].last4) in rest.text

        revoked = await http.get("/admin/keys", params={"status": "revoked"})
        assert revoked.text.count('<code class="key">') == 1 and "badge-danger" in revoked.text
        expired = await http.get("/admin/keys", params={"status": "expired"})
        assert expired.text.count('<code class="key">') == 1
        assert display_key(old.public_id, old.last4) in expired.text
        active = await http.get("/admin/keys", params={"status": "active", "tenant": "acme"})
        assert active.text.count('<code class="key">') == 50
        # the tenant link, not the bare name: a random key id can contain "beta"
        assert 'href="/admin/tenants/beta"' not in active.text
        assert display_key(old.public_id, old.last4) not in active.text
        missing = await http.get("/admin/keys", params={"tenant": "nobody"})
        assert "There is no tenant named &#39;nobody&#39;." in missing.text


async def test_revoking_goes_back_where_it_came_from(web: WebEnv) -> None:
    make_tenant(web, "acme")
    with web.store.db.session() as session:
        key = service.create_key(session, "admin", service.require_tenant(session, "acme"))[1]
    path = f"/admin/keys/{key.public_id}/revoke"
    async with web.http() as http:
        await sign_in(http)
        confirm = await http.get(path, params={"back": "/admin/keys"})
        assert '<input type="hidden" name="back" value="/admin/keys">' in confirm.text
        response = await post_form(http, path, path, {"back": "/admin/keys"})
        assert response.headers["location"] == "/admin/keys"
        again = await post_form(http, "/admin/keys", path, {"back": "https://evil.example/"})
        assert again.headers["location"] == "/admin/tenants/acme"  # never another site
        assert "was already revoked" in (await http.get("/admin/tenants/acme")).text
        assert "This key is already revoked." in (await http.get(path)).text
        assert (await http.get("/admin/keys/nokey/revoke")).status_code == 404
        assert (await http.get("/admin/keys/nokey/created")).status_code == 404
    with web.store.db.session() as session:
        events = session.execute(select(AuditEvent.action, AuditEvent.actor)).all()
    assert [tuple(e) for e in events].count(("key.revoke", WEB_ACTOR)) == 1


def test_one_time_secrets() -> None:
    now = [0.0]
    store = OneTimeSecrets(ttl_s=60, max_items=2, clock=lambda: now[0])
    mine = WebSession("csrf-a", 0, 0, "v", 0)
    theirs = WebSession("csrf-b", 0, 0, "v", 0)
    store.put(mine, "k1", "secret-1")
    assert store.take(theirs, "k1") is None
    assert store.take(mine, "k1") == "secret-1"
    assert store.take(mine, "k1") is None  # once
    store.put(mine, "k2", "secret-2")
    now[0] = 61
    assert store.take(mine, "k2") is None  # too late
    for i in range(3):
        store.put(mine, f"n{i}", "s")
    assert store.take(mine, "n0") is None and store.take(mine, "n2") == "s"  # bounded


async def test_every_url_keeps_a_path_prefix(web: WebEnv) -> None:
    """Behind a proxy at /lp: links, forms and redirects of these pages stay under /lp/admin."""
    async with web.http(root_path="/lp") as http:
        await sign_in(http, prefix="/lp")
        created = await post_form(
            http, "/lp/admin/tenants/-/new", "/lp/admin/tenants", {"name": "acme"}
        )
        assert created.headers["location"] == "/lp/admin/tenants/acme"
        response = await post_form(
            http, "/lp/admin/keys/new", "/lp/admin/keys", {"tenant": "acme", "scopes": "inference"}
        )
        key_path = response.headers["location"]
        assert key_path.startswith("/lp/admin/keys/")
        public_id = key_path.split("/")[4]
        revoke = f"/lp/admin/keys/{public_id}/revoke"
        for path in (
            "/lp/admin/tenants", "/lp/admin/tenants?page=1&q=a", "/lp/admin/tenants/-/new",
            "/lp/admin/tenants/acme", "/lp/admin/tenants/acme/edit",
            "/lp/admin/tenants/acme/delete", "/lp/admin/keys", "/lp/admin/keys/new", key_path,
            f"{revoke}?back=/admin/keys", "/lp/admin/audit?tenant=acme",
        ):  # fmt: skip
            page = await http.get(path)
            assert page.status_code == 200, path
            urls = re.findall(r'(?:href|src|action)="([^"#][^"]*)"', page.text)
            assert urls and all(u.startswith("/lp/admin") for u in urls), (path, urls)
        done = await post_form(http, revoke, revoke, {"back": "/admin/keys"})
        assert done.headers["location"] == "/lp/admin/keys"


async def test_a_key_limited_to_models_in_the_form_and_edited_later(web: WebEnv) -> None:
    """Issue 34.3 in the UI: the key form's Models field, the Models column, the edit page;
    the API follows from the key's next request."""
    make_tenant(web, "acme")
    async with web.http() as http:
        await sign_in(http)
        form = await http.get("/admin/keys/new", params={"tenant": "acme"})
        assert 'name="allowed_models"' in form.text and "every version" in form.text
        response = await new_key(http, tenant="acme", allowed_models="pirate, caps@1\npirate")
        assert response.status_code == 303, response.text
        public_id = response.headers["location"].split("/")[3]
        token = KEY.findall((await http.get(response.headers["location"])).text)[0]
        assert key_row(web, public_id).allowed_models == ["pirate", "caps@1"]
        listed = await http.get("/admin/keys")
        assert "<th" in listed.text and ">Models<" in listed.text
        assert "pirate, caps@1" in listed.text
        refused = await http.get("/v1/models/tiny-model", headers=bearer(token))
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"

        edit = f"/admin/keys/{public_id}/edit"
        page = await http.get(edit)
        assert 'value="pirate, caps@1"' in page.text
        bad = await post_form(http, edit, edit, {"name": "n", "allowed_models": "a b"})
        assert bad.status_code == 400 and 'id="f-allowed_models-help"' in bad.text
        saved = await post_form(http, edit, edit, {"name": "base only",
                                                   "allowed_models": "tiny-model"})  # fmt: skip
        assert saved.status_code == 303 and saved.headers["location"] == "/admin/tenants/acme"
        tenant_page = await http.get("/admin/tenants/acme")
        assert "models tiny-model, from its next request" in tenant_page.text
        models = (await http.get("/v1/models", headers=bearer(token))).json()["data"]
        assert [m["id"] for m in models] == ["tiny-model"]
        cleared = await post_form(http, edit, edit, {"name": "base only", "allowed_models": ""})
        assert cleared.status_code == 303
    row = key_row(web, public_id)
    assert row.allowed_models is None and row.name == "base only"
    with web.store.db.session() as session:
        actions = session.scalars(select(AuditEvent.action).order_by(AuditEvent.id)).all()
        assert actions.count("key.update") == 2
