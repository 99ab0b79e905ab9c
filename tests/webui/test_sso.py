"""Single sign-on against a real OpenID provider (Node's ``oidc-provider``, started per test):
the authorization-code flow with PKCE, roles from the ``groups`` claim (read from userinfo:
this provider leaves it out of the ID token), the viewer's read-only role on the pages and the
admin API, the session cookie's attributes, and the state / nonce / flow-cookie checks failing
closed (no session) when anything is altered, missing or late.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from loraplex.webui.context import SESSION_COOKIE
from loraplex.webui.oidc import OIDCClient
from loraplex.webui.sso import FLOW_COOKIE, Flow, flow_key, seal, unseal
from tests.utils.oidc import (
    BASE,
    Provider,
    needs_provider,
    provider,
    sign_in_at_provider,
    sso_settings,
    sso_sign_in,
    start_sign_in,
)
from tests.utils.web import ADMIN_TOKEN, WebEnv, csrf_of, post_form, sign_in

pytestmark = [pytest.mark.anyio, needs_provider]


@pytest.fixture(scope="module")
def idp() -> Iterator[Provider]:
    """One provider for the module (each test signs in afresh; the provider keeps no grant)."""
    with provider([BASE + "/admin/sso/callback", "https://localhost/admin/sso/callback"]) as p:
        yield p


@pytest.fixture
def sso_web(tmp_path: Path, idp: Provider) -> Iterator[WebEnv]:
    env = WebEnv.build(tmp_path)
    try:
        env.webui.sso = OIDCClient(sso_settings(idp.issuer, BASE))
        yield env
    finally:
        env.close()


@pytest.fixture
async def http(sso_web: WebEnv) -> AsyncIterator[httpx.AsyncClient]:
    async with sso_web.http(base_url=BASE) as client:
        yield client


def session_cookie_header(response: httpx.Response) -> str:
    found = [h for h in response.headers.get_list("set-cookie") if h.startswith(SESSION_COOKIE)]
    assert len(found) == 1, response.headers.get_list("set-cookie")
    return found[0]


def put_flow_cookie(http: httpx.AsyncClient, value: str) -> None:
    """Replace (or plant) the flow cookie, as a browser's user could."""
    http.cookies.jar.clear_expired_cookies()
    for cookie in list(http.cookies.jar):
        if cookie.name == FLOW_COOKIE:
            http.cookies.jar.clear(cookie.domain, cookie.path, cookie.name)
    http.cookies.set(FLOW_COOKIE, value, domain="localhost.local", path="/admin/sso")


def no_session(response: httpx.Response) -> bool:
    return not any(
        h.startswith(SESSION_COOKIE + "=") and "Max-Age=0" not in h
        for h in response.headers.get_list("set-cookie")
    )


async def test_an_operator_signs_in_and_may_write(sso_web: WebEnv, http: httpx.AsyncClient) -> None:
    r = await sso_sign_in(http, "alice")
    assert r.status_code == 303 and r.headers["location"] == "/admin/tenants", r.text
    cookie = session_cookie_header(r).lower()
    assert "httponly" in cookie and "samesite=lax" in cookie and "max-age=86400" in cookie
    assert "secure" not in cookie  # plain http here; see the TLS test below
    page = await http.get("/admin/tenants")
    assert page.status_code == 200 and "alice · operator" in page.text
    assert "read-only-notice" not in page.text
    made = await post_form(
        http, "/admin/tenants/-/new", "/admin/tenants", {"name": "globex", "display_name": "G"}
    )
    assert made.status_code == 303, made.text
    # The admin API with the session's cookie: reads; a write needs the session's CSRF token.
    listed = await http.get("/admin/api/tenants")
    assert [t["name"] for t in listed.json()["data"]] == ["globex"]
    bare = await http.post("/admin/api/tenants", json={"name": "initech"})
    assert bare.status_code == 403 and bare.json()["error"]["code"] == "csrf_token_required"
    token = csrf_of((await http.get("/admin/tenants")).text)
    ok = await http.post(
        "/admin/api/tenants", json={"name": "initech"}, headers={"X-CSRF-Token": token}
    )
    assert ok.status_code == 201, ok.text


async def test_a_viewer_reads_every_page_but_writes_nothing(
    sso_web: WebEnv, http: httpx.AsyncClient
) -> None:
    async with sso_web.http(base_url=BASE) as operator:
        assert (await sign_in(operator)).status_code == 303  # the admin token still works
        made = await post_form(
            operator, "/admin/tenants/-/new", "/admin/tenants", {"name": "acme", "display_name": ""}
        )
        assert made.status_code == 303
    r = await sso_sign_in(http, "bob")
    assert r.status_code == 303, r.text
    for path in ("/admin", "/admin/tenants", "/admin/tenants/acme", "/admin/keys", "/admin/audit"):
        page = await http.get(path)
        assert page.status_code == 200, (path, page.status_code)
        assert "bob · viewer" in page.text and 'id="read-only-notice"' in page.text
        assert 'class="read-only"' in page.text  # the stylesheet hides its write forms
    # A form's POST, with a valid CSRF token: 403, nothing created.
    refused = await post_form(
        http, "/admin/tenants", "/admin/tenants", {"name": "evil", "display_name": ""}
    )
    assert refused.status_code == 403 and "viewer role" in refused.text
    # The admin API: reads yes, writes 403 read_only_role (with or without the CSRF token).
    assert (await http.get("/admin/api/tenants/acme")).status_code == 200
    token = csrf_of((await http.get("/admin/tenants")).text)
    for method, path, body in (
        ("POST", "/admin/api/tenants", {"name": "evil"}),
        ("PATCH", "/admin/api/tenants/acme", {"display_name": "x"}),
        ("DELETE", "/admin/api/tenants/acme", None),
    ):
        api = await http.request(method, path, json=body, headers={"X-CSRF-Token": token})
        assert api.status_code == 403, (method, path, api.text)
        error = api.json()["error"]
        assert error["code"] == "read_only_role" and "read-only" in error["message"]
    names = [t["name"] for t in (await http.get("/admin/api/tenants")).json()["data"]]
    assert names == ["acme"]
    # Signing out works for a viewer, and ends the session.
    out = await post_form(http, "/admin", "/admin/logout", {})
    assert out.status_code == 303 and "signed_out" in out.headers["location"]
    assert (await http.get("/admin")).status_code == 303
    assert (await http.get("/admin/api/tenants")).status_code == 401


async def test_an_account_without_a_mapped_group_gets_no_session(http: httpx.AsyncClient) -> None:
    r = await sso_sign_in(http, "carol")
    assert r.status_code == 403 and "no role in loraplex" in r.text
    assert no_session(r)
    assert (await http.get("/admin")).status_code == 303  # still signed out


async def test_an_altered_state_is_refused_and_the_flow_is_spent(http: httpx.AsyncClient) -> None:
    callback = sign_in_at_provider(await start_sign_in(http), "alice", BASE)
    query = parse_qs(urlsplit(callback).query)
    altered = callback.replace(query["state"][0], query["state"][0][:-2] + "xx")
    r = await http.get(altered)
    assert r.status_code == 400 and "state does not belong" in r.text and no_session(r)
    # The flow cookie went with the refusal: the genuine answer is refused too (one use).
    again = await http.get(callback)
    assert again.status_code == 400 and "no sign-in was started" in again.text
    assert no_session(again)
    missing = await http.get(callback.split("&state=")[0])
    assert missing.status_code == 400 and no_session(missing)


async def test_a_missing_or_altered_flow_cookie_is_refused(
    sso_web: WebEnv, http: httpx.AsyncClient
) -> None:
    callback = sign_in_at_provider(await start_sign_in(http), "alice", BASE)
    sealed = http.cookies[FLOW_COOKIE]
    async with sso_web.http(base_url=BASE) as other_browser:  # no flow cookie at all
        r = await other_browser.get(callback)
        assert r.status_code == 400 and "no sign-in was started" in r.text and no_session(r)
        body, mac = sealed.split(".")
        for forged in (body[:-3] + "abc." + mac, body + "." + mac[:-3] + "abc", "garbage"):
            put_flow_cookie(other_browser, forged)
            r = await other_browser.get(callback)
            assert r.status_code == 400 and "altered" in r.text and no_session(r), forged
    ok = await http.get(callback)  # the untouched flow still completes
    assert ok.status_code == 303 and not no_session(ok)


async def test_a_nonce_other_than_the_id_tokens_is_refused(
    sso_web: WebEnv, http: httpx.AsyncClient
) -> None:
    """The cookie re-sealed with the right key (as if the seal held) but another nonce: the ID
    token's nonce check alone refuses it."""
    assert sso_web.webui.sso is not None
    key = flow_key(sso_web.webui.sso)
    callback = sign_in_at_provider(await start_sign_in(http), "alice", BASE)
    flow = unseal(http.cookies[FLOW_COOKIE], key, time.time())
    put_flow_cookie(http, seal(dataclasses.replace(flow, nonce=flow.nonce[::-1]), key))
    r = await http.get(callback)
    assert r.status_code == 400 and "nonce does not match" in r.text and no_session(r)


async def test_a_late_answer_is_refused(sso_web: WebEnv, http: httpx.AsyncClient) -> None:
    assert sso_web.webui.sso is not None
    key = flow_key(sso_web.webui.sso)
    callback = sign_in_at_provider(await start_sign_in(http), "alice", BASE)
    flow = unseal(http.cookies[FLOW_COOKIE], key, time.time())
    late: Flow = dataclasses.replace(flow, expires=time.time() - 1)
    put_flow_cookie(http, seal(late, key))
    r = await http.get(callback)
    assert r.status_code == 400 and "longer than 10 minutes" in r.text and no_session(r)


async def test_over_tls_the_cookies_are_secure(sso_web: WebEnv) -> None:
    assert sso_web.webui.sso is not None
    sso_web.webui.sso = OIDCClient(sso_settings(sso_web.webui.sso.issuer, "https://localhost"))
    async with sso_web.http(base_url="https://localhost") as http:
        r = await http.get("/admin/sso/login")
        flow_cookie = r.headers["set-cookie"].lower()
        assert "secure" in flow_cookie and "samesite=lax" in flow_cookie
        assert "path=/admin/sso" in flow_cookie and "max-age=600" in flow_cookie
        callback = sign_in_at_provider(r.headers["location"], "alice", "https://localhost")
        done = await http.get(callback)
        assert done.status_code == 303, done.text
        assert "secure" in session_cookie_header(done).lower()


async def test_the_admin_token_still_signs_in_beside_sso(
    sso_web: WebEnv, http: httpx.AsyncClient
) -> None:
    page = await http.get("/admin/login")
    assert 'id="sso-sign-in"' in page.text and "Sign in with Test IdP" in page.text
    assert (await sign_in(http)).status_code == 303
    api = await http.get("/admin/api/tenants", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert api.status_code == 200
