"""Webhooks and the viewer role (issue 34.2 with 34.5): a receiver's URL often carries its
credential (Slack's and Teams' incoming webhooks do), so a viewer signed in through the local
OpenID provider sees each receiver's origin only, on the page and through the admin API;
operators see the whole URL."""

from __future__ import annotations

import httpx
import pytest

from loraplex.platform.webhooks import store
from loraplex.platform.webhooks.redact import viewer_error, viewer_url
from tests.utils.oidc import BASE, needs_provider, sso_sign_in
from tests.utils.web import WebEnv, sign_in

pytestmark = pytest.mark.anyio

SECRET_URL = "https://hooks.example.com/services/T000/B000/XXXXsecretXXXX?token=abc"


def test_viewer_url_keeps_the_origin_only() -> None:
    assert viewer_url(SECRET_URL) == "https://hooks.example.com/…"
    assert viewer_url("http://10.0.0.5:8080") == "http://10.0.0.5:8080/"
    assert viewer_url("http://[::1]:9/x#f") == "http://[::1]:9/…"
    assert viewer_error("HTTP 302: redirects are not followed (Location: https://x/y?t=1)") == (
        "HTTP 302: redirects are not followed (Location: …)"
    )
    assert viewer_error("no answer within 5 s") == "no answer within 5 s"
    assert viewer_error(None) is None


@needs_provider
async def test_a_viewer_sees_receivers_origins_only(
    sso_web: WebEnv, sso_http: httpx.AsyncClient
) -> None:
    with sso_web.store.db.session() as session:
        store.create_webhook(session, "admin", SECRET_URL, ["key.expiring"], "slack")
    async with sso_web.http(base_url=BASE) as operator:
        assert (await sign_in(operator)).status_code == 303
        assert "XXXXsecretXXXX" in (await operator.get("/admin/webhooks")).text
        assert (await operator.get("/admin/api/webhooks")).json()["data"][0]["url"] == SECRET_URL
    assert (await sso_sign_in(sso_http, "bob")).status_code == 303  # bob: a viewer
    page = await sso_http.get("/admin/webhooks")
    assert page.status_code == 200 and "hooks.example.com" in page.text
    assert "XXXXsecretXXXX" not in page.text and "token=abc" not in page.text
    listing = await sso_http.get("/admin/api/webhooks")
    assert listing.status_code == 200
    (hook,) = listing.json()["data"]
    assert hook["url"] == "https://hooks.example.com/…"
    one = await sso_http.get(f"/admin/api/webhooks/{hook['id']}")
    assert one.json()["url"] == "https://hooks.example.com/…"
