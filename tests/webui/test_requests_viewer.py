"""The request log and the viewer role (issue 34.4 with 34.5): a viewer signed in through the
local OpenID provider finds requests on the Requests page and through the admin API, but not
the bodies a tenant opted in to store (shown to operators only)."""

from __future__ import annotations

import httpx
import pytest

from tests.utils.oidc import BASE, needs_provider, sso_sign_in
from tests.utils.request_logs import add_log_rows
from tests.utils.web import WebEnv, sign_in

pytestmark = [pytest.mark.anyio, needs_provider]


async def test_a_viewer_sees_requests_but_not_bodies(
    sso_web: WebEnv, sso_http: httpx.AsyncClient
) -> None:
    add_log_rows(sso_web, "beta", 1, status=503, request_body='{"secret": "of beta"}',
              response_body="no")  # fmt: skip
    async with sso_web.http(base_url=BASE) as operator:
        assert (await sign_in(operator)).status_code == 303
        page = await operator.get("/admin/requests/beta-503-0")
        assert "of beta" in page.text
        api = await operator.get("/admin/requests.csv")
        assert api.status_code == 200
    assert (await sso_sign_in(sso_http, "bob")).status_code == 303  # bob: a viewer
    listing = await sso_http.get("/admin/requests?status=5xx")
    assert listing.status_code == 200 and "beta-503-0" in listing.text
    page = await sso_http.get("/admin/requests/beta-503-0")
    assert page.status_code == 200 and "of beta" not in page.text
    assert "shown to operators only" in page.text
    api = await sso_http.get("/admin/api/requests/beta-503-0")
    assert api.status_code == 200
    body = api.json()
    assert body["has_bodies"] is True and body["request_body"] is None
    assert body["response_body"] is None
    assert (await sso_http.get("/admin/api/requests?tenant=beta")).json()["data"][0][
        "status"
    ] == 503
