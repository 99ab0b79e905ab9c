"""Small hardening of the admin UI: static files say ``nosniff``, an unknown admin address is a
page (not the API's JSON), and failed sign-ins from one address never lock out the right token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.webui.context import STATIC_DIR
from loraplex.webui.sessions import LoginThrottle
from tests.utils.web import ADMIN_TOKEN, WebEnv, sign_in

pytestmark = pytest.mark.anyio


async def test_static_files_are_nosniff(web: WebEnv) -> None:
    names = sorted(
        p.relative_to(STATIC_DIR).as_posix() for p in STATIC_DIR.rglob("*") if p.is_file()
    )
    assert names
    async with web.http() as http:
        for name in names:
            response = await http.get(f"/admin/static/{name}")
            assert response.status_code == 200, name
            assert response.headers["x-content-type-options"] == "nosniff", name


async def test_an_unknown_admin_address_is_a_page(web: WebEnv) -> None:
    async with web.http() as http:
        for path in ("/admin/nope", "/admin/tenants/acme/nothing/here"):
            response = await http.get(path)
            assert response.status_code == 404, path
            assert response.headers["content-type"].startswith("text/html"), path
            assert "Page not found" in response.text and 'href="/admin"' in response.text
            assert response.headers["x-frame-options"] == "DENY"
        api = await http.get("/admin/api/nope")  # the admin API keeps its JSON errors
        assert api.status_code == 404 and api.json()["error"]["code"]
        static = await http.get("/admin/static/nope.css")
        assert static.status_code == 404 and "Page not found" not in static.text


async def test_failures_from_one_address_never_lock_out_the_right_token(tmp_path: Path) -> None:
    """Behind one proxy everyone has the proxy's address: a neighbour failing on purpose must
    not keep the operator out (the throttle slows down failures only)."""
    env = WebEnv.build(tmp_path)
    env.webui.throttle = LoginThrottle(max_failures=2, window_s=3600)
    try:
        async with env.http() as attacker, env.http() as operator:
            for _ in range(5):
                await sign_in(attacker, "wrong-token-0123456789")
            assert (await sign_in(attacker, "wrong-token-0123456789")).status_code == 429
            response = await sign_in(operator, ADMIN_TOKEN)  # same address, the right token
            assert response.status_code == 303 and response.headers["location"] == "/admin"
    finally:
        env.close()
