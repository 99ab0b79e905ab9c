"""The admin UI's door: sessions, CSRF, throttling, redirects, and that no API key opens it.

The route lists come from the app itself (every GET/POST route the web UI mounted), so a page
added later is covered by these tests without touching them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from fastapi.routing import APIRoute

from loraplex.platform import admin_token
from loraplex.webui import PAGES, login
from loraplex.webui.context import SESSION_COOKIE
from loraplex.webui.sessions import LoginThrottle, SessionStore
from tests.utils.web import ADMIN_TOKEN, WebEnv, csrf_of, sign_in

pytestmark = pytest.mark.anyio


def webui_routes(method: str) -> list[str]:
    """Paths of the web UI's routes for ``method``, path parameters filled with 'x'."""
    routers = [login.router, *(page.router for page in PAGES)]
    paths = []
    for router in routers:
        for route in router.routes:
            if isinstance(route, APIRoute) and method in route.methods:
                paths.append(re.sub(r"\{[^}]+\}", "x", route.path))
    assert paths, f"no {method} routes found"
    return paths


def protected_gets() -> list[str]:
    return [p for p in webui_routes("GET") if p not in ("/admin/login", "/admin/")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def set_cookies(response: httpx.Response) -> dict[str, str]:
    """Each Set-Cookie header of ``response``, by cookie name."""
    out = {}
    for header in response.headers.get_list("set-cookie"):
        out[header.split("=", 1)[0]] = header
    return out


def location(response: httpx.Response) -> str:
    assert response.status_code in (303, 307), (response.status_code, response.text[:300])
    return response.headers["location"]


# ---- pages without a session -----------------------------------------------------------------


async def test_every_page_without_a_session_redirects_to_sign_in(web: WebEnv) -> None:
    async with web.http() as http:
        for path in protected_gets():
            response = await http.get(path, params={"page": "2"})
            if path.endswith(".json") or path.startswith("/admin/overview/"):
                assert response.status_code == 401, path  # polled by scripts: JSON, not a page
                assert response.json()["error"]["code"] == "admin_session_required"
                continue
            target = urlsplit(location(response))
            assert target.scheme == "" and target.netloc == "", "redirects are paths only"
            assert target.path == "/admin/login"
            assert parse_qs(target.query)["next"] == [f"{path}?page=2"]


async def test_signing_in_returns_to_the_page_asked_for(web: WebEnv) -> None:
    async with web.http() as http:
        first = await http.get("/admin", params={"x": "1"})
        next_path = parse_qs(urlsplit(location(first)).query)["next"][0]
        response = await sign_in(http, next_path=next_path)
        assert location(response) == "/admin?x=1"
        page = await http.get("/admin")
        assert page.status_code == 200
        assert "Signed in." in page.text  # the flash, shown once
        assert "Signed in." not in (await http.get("/admin")).text


@pytest.mark.parametrize(
    "next_path",
    [
        "https://evil.example/",
        "//evil.example/admin",
        "/\\evil.example",
        "/admin//evil.example",
        "/admin/../v1/models",
        "javascript:alert(1)",
        "/v1/models",
        "/admin\r\nLocation: https://evil.example",
        "",
    ],
)
async def test_next_never_leaves_the_admin_pages(web: WebEnv, next_path: str) -> None:
    async with web.http() as http:
        response = await sign_in(http, next_path=next_path)
        assert location(response) == "/admin"
        form = await http.get("/admin/login", params={"next": next_path})
        assert location(form) == "/admin"  # already signed in: straight on, to a safe place


async def test_a_path_prefix_is_kept_in_every_url(web: WebEnv) -> None:
    async with web.http(root_path="/lp") as http:
        first = await http.get("/lp/admin")
        assert location(first) == "/lp/admin/login?next=%2Fadmin"
        response = await sign_in(http, prefix="/lp")
        assert location(response) == "/lp/admin"
        assert "Path=/lp/admin;" in set_cookies(response)[SESSION_COOKIE]
        page = await http.get("/lp/admin")
        assert page.status_code == 200
        urls = re.findall(r'(?:href|src|action|data-[a-z-]+-src)="([^"]+)"', page.text)
        urls = [u for u in urls if not u.startswith("#")]
        assert urls and all(u.startswith("/lp/admin") for u in urls), urls
        assert (await http.get("/lp/admin/static/admin.css")).status_code == 200


# ---- the session cookie ------------------------------------------------------------------------


async def test_session_cookie_is_httponly_strict_and_secure_only_over_https(web: WebEnv) -> None:
    async with web.http() as http:
        cookie = set_cookies(await sign_in(http))[SESSION_COOKIE]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin;" in cookie
        assert "Secure" not in cookie  # plain HTTP: a Secure cookie would never come back
    async with web.http(base_url="https://test") as http:
        cookie = set_cookies(await sign_in(http))[SESSION_COOKIE]
        assert "Secure" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    # X-Forwarded-Proto is ignored unless the operator says a proxy sets it.
    async with web.http() as http:
        http.headers["X-Forwarded-Proto"] = "https"
        assert "Secure" not in set_cookies(await sign_in(http))[SESSION_COOKIE]


async def test_forwarded_proto_counts_when_proxy_headers_are_trusted(tmp_path: Path) -> None:
    env = WebEnv.build(tmp_path, trust_proxy_headers=True)
    try:
        async with env.http() as http:
            http.headers["X-Forwarded-Proto"] = "https"
            form = await http.get("/admin/login")
            login_cookie = set_cookies(form)["lpx_admin_login"]
            assert "Secure" in login_cookie
            # httpx keeps Secure cookies off plain HTTP; the proxy's browser sends it over TLS.
            token = csrf_of(form.text)
            response = await http.post(
                "/admin/login",
                data={"csrf_token": token, "token": ADMIN_TOKEN},
                headers={"Cookie": f"lpx_admin_login={token}"},
            )
            assert "Secure" in set_cookies(response)[SESSION_COOKIE]
    finally:
        env.close()


async def test_sign_out_ends_the_session_for_good(web: WebEnv) -> None:
    async with web.http() as http:
        await sign_in(http)
        session_id = http.cookies[SESSION_COOKIE]
        page = await http.get("/admin")
        response = await http.post("/admin/logout", data={"csrf_token": csrf_of(page.text)})
        assert location(response) == "/admin/login?notice=signed_out"
        assert "Max-Age=0" in set_cookies(response)[SESSION_COOKIE]
        assert "You have signed out." in (await http.get(location(response))).text
    async with web.http() as replay:  # the old cookie, sent again, opens nothing
        replay.cookies.set(SESSION_COOKIE, session_id)
        response = await replay.get("/admin")
        assert "notice=expired" in location(response)


async def test_a_session_id_planted_before_sign_in_is_not_kept(web: WebEnv) -> None:
    async with web.http() as http:
        http.cookies.set(SESSION_COOKIE, "planted-by-someone-else", path="/admin")
        response = await sign_in(http)
        issued = set_cookies(response)[SESSION_COOKIE]
        assert "planted-by-someone-else" not in issued
        assert (await http.get("/admin")).status_code == 200


async def test_an_idle_session_expires(web: WebEnv) -> None:
    clock = Clock()
    web.webui.sessions = SessionStore(idle_timeout_s=60, max_age_s=3600, clock=clock)
    async with web.http() as http:
        await sign_in(http)
        clock.now += 59
        assert (await http.get("/admin")).status_code == 200
        clock.now += 61
        assert "notice=expired" in location(await http.get("/admin"))


async def test_rotating_the_admin_token_signs_browsers_out(tmp_path: Path) -> None:
    env = WebEnv.build(tmp_path, tenancy={"admin_token": None})
    started = admin_token.ensure(env.store.db, env.store.settings)
    assert started.source == "generated" and started.token
    clock = Clock()
    env.webui.sessions = SessionStore(clock=clock)
    try:
        async with env.http() as http:
            assert (await sign_in(http, ADMIN_TOKEN)).status_code == 401  # not this database's
            assert location(await sign_in(http, started.token)) == "/admin"
            assert (await http.get("/admin")).status_code == 200
            env.store.db.call(lambda s: admin_token.rotate(s, env.store.settings, "admin"))
            clock.now += 11  # the session re-checks the token at most every 10 s
            assert "notice=expired" in location(await http.get("/admin"))
    finally:
        env.close()


# ---- CSRF ----------------------------------------------------------------------------------------


async def test_every_post_without_a_valid_csrf_token_is_refused(web: WebEnv) -> None:
    async with web.http() as http, web.http() as other:
        await sign_in(http)
        await sign_in(other)
        own = csrf_of((await http.get("/admin")).text)
        foreign = csrf_of((await other.get("/admin")).text)
        for path in webui_routes("POST"):
            for data in ({}, {"csrf_token": ""}, {"csrf_token": "forged"}, {"csrf_token": foreign}):
                response = await http.post(path, data={**data, "token": ADMIN_TOKEN})
                assert response.status_code == 403, (path, data, response.status_code)
                assert "text/html" in response.headers["content-type"]
                assert "refused" in response.text
        # the session survived all that, and its own token works
        assert (await http.get("/admin")).status_code == 200
        response = await http.post("/admin/logout", data={"csrf_token": own})
        assert response.status_code == 303


async def test_a_post_without_a_session_is_refused(web: WebEnv) -> None:
    async with web.http() as http:
        for path in webui_routes("POST"):
            if path == "/admin/login":
                continue
            response = await http.post(path, data={"csrf_token": "x"})
            assert response.status_code == 403, path
            assert "Sign in" in response.text


async def test_the_sign_in_form_needs_its_own_cookie_token(web: WebEnv) -> None:
    async with web.http() as http:
        form = await http.get("/admin/login")
        token = csrf_of(form.text)
        http.cookies.clear()  # a cross-site post carries no SameSite=Strict cookie
        response = await http.post("/admin/login", data={"csrf_token": token, "token": ADMIN_TOKEN})
        assert response.status_code == 403
        assert SESSION_COOKIE not in set_cookies(response)


# ---- throttling -----------------------------------------------------------------------------------


async def test_repeated_failures_are_throttled_per_client(tmp_path: Path) -> None:
    env = WebEnv.build(tmp_path, trust_proxy_headers=True)
    clock = Clock()
    env.webui.throttle = LoginThrottle(max_failures=3, window_s=60, clock=clock)
    try:
        async with env.http() as http, env.http() as neighbour:
            http.headers["X-Forwarded-For"] = "198.51.100.7"
            neighbour.headers["X-Forwarded-For"] = "203.0.113.9"
            for _ in range(2):
                response = await sign_in(http, "wrong-token-0123456789")
                assert response.status_code == 401
                assert "not the admin token" in response.text
            response = await sign_in(http, "wrong-token-0123456789")
            assert response.status_code == 429
            assert response.headers["retry-after"] == "60"
            assert "Too many failed sign-ins" in response.text
            # while throttled, wrong tokens keep waiting...
            clock.now += 30
            response = await sign_in(http, "wrong-token-0123456789")
            assert response.status_code == 429 and response.headers["retry-after"] == "30"
            assert SESSION_COOKIE not in set_cookies(response)
            # ...but the right one is never locked out by failures from the same address
            assert location(await sign_in(http, ADMIN_TOKEN)) == "/admin"
            # another address is not affected
            assert location(await sign_in(neighbour)) == "/admin"
    finally:
        env.close()


def test_throttle_window_and_reset() -> None:
    clock = Clock()
    throttle = LoginThrottle(max_failures=2, window_s=10, clock=clock)
    throttle.failed("a")
    clock.now += 6
    throttle.failed("a")
    assert throttle.retry_after("a") == 4  # until the first failure leaves the window
    clock.now += 4
    assert throttle.retry_after("a") == 0
    throttle.failed("a")
    assert throttle.retry_after("a") == 6
    throttle.succeeded("a")
    assert throttle.retry_after("a") == 0


# ---- API keys never open a page -----------------------------------------------------------------


async def test_a_tenant_key_opens_no_admin_page(web: WebEnv) -> None:
    key = web.tenant_key("acme")
    async with web.http() as http:
        for path in protected_gets():
            for headers, cookies, refused in (
                ({"Authorization": f"Bearer {key}"}, {}, (403,)),  # a tenant's key: refused
                ({}, {SESSION_COOKIE: key}, (303, 401)),
                ({"Authorization": f"Bearer {ADMIN_TOKEN}"}, {}, (303, 401)),  # needs a session
            ):
                http.cookies.clear()
                for name, value in cookies.items():
                    http.cookies.set(name, value)
                response = await http.get(path, headers=headers)
                assert response.status_code in refused, (path, headers, cookies)
        response = await sign_in(http, key)
        assert response.status_code == 401
        assert "tenant API key" in response.text
        assert SESSION_COOKIE not in set_cookies(response)


async def test_pages_send_strict_security_headers(web: WebEnv) -> None:
    async with web.http() as http:
        for response in (await http.get("/admin/login"), await sign_in(http)):
            csp = response.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
            assert response.headers["x-frame-options"] == "DENY"
        page = await http.get("/admin")
        assert page.headers["cache-control"] == "no-store"
        assert "<script>" not in page.text and " style=" not in page.text  # nothing inline


# ---- the Overview's engine states ---------------------------------------------------------------


async def test_a_dead_engine_is_a_state_not_an_error(web: WebEnv) -> None:
    web.fake.alive = False
    async with web.http() as http:
        await sign_in(http)
        page = await http.get("/admin")
        assert page.status_code == 200
        assert "Engine down." in page.text and 'class="engine is-down"' in page.text
        data = (await http.get("/admin/overview.json")).json()
        assert data["engine"]["up"] is False and data["engine"]["display"]["running"] == "—"


async def test_a_hung_engine_shows_as_down_after_the_timeout(web: WebEnv) -> None:
    web.fake.stats_delay = 5.0
    web.webui.monitor.timeout_s = 0.05
    async with web.http() as http:
        await sign_in(http)
        data = (await http.get("/admin/overview.json")).json()
        assert data["engine"]["up"] is False
        assert "did not answer" in data["engine"]["error"]


async def test_engine_text_is_escaped(web: WebEnv) -> None:
    async def stats() -> dict[str, Any]:
        raise RuntimeError("<script>alert(1)</script>")

    web.fake.stats = stats  # type: ignore[method-assign]
    async with web.http() as http:
        await sign_in(http)
        page = await http.get("/admin")
        assert "<script>alert(1)</script>" not in page.text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text


async def test_overview_json_carries_the_live_numbers(web: WebEnv) -> None:
    async with web.http() as http:
        await sign_in(http)
        web.fake.engine_stats.update(num_running=7, kv_cache_usage=0.5)
        data = (await http.get("/admin/overview.json")).json()["engine"]
        assert data["up"] is True
        assert data["display"]["running"] == "7" and data["display"]["kv_usage"] == "50.0%"
        assert data["display"]["adapters_device"] == "2" and data["kv_usage"] == 0.5
        fragment = await http.get("/admin/overview/charts")
        assert fragment.status_code == 200 and "<svg" in fragment.text
