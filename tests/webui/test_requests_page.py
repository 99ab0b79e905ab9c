"""The Requests page (issue 34.4): the request log newest first with filters shown beside their
fields, keyset pages, a request's page (bodies escaped), the CSV export, sign-in required."""

from __future__ import annotations

import csv
import io
import re

import pytest

from tests.utils.request_logs import add_log_rows
from tests.utils.tenancy import bearer
from tests.utils.web import WebEnv, sign_in

pytestmark = pytest.mark.anyio

ROW_ID = re.compile(r'class="mono small request-link" href="[^"]+">([^<]+)</a>')


async def test_pages_filters_and_a_request(web: WebEnv) -> None:
    add_log_rows(web, "acme", 60)
    add_log_rows(web, "beta", 2, status=503, request_body='{"x": "<script>alert(1)</script>"}',
              response_body="<b>no</b>")  # fmt: skip
    key = web.tenant_key("acme")
    async with web.http() as http:
        r = await http.get("/admin/requests")
        assert r.status_code in (302, 303) and "/admin/login" in r.headers["location"]
        await sign_in(http)
        # A refused request through the API appears at the top.
        refused = await http.post("/v1/chat/completions", headers=bearer(key),
                                  json={"model": "nope", "messages": []})  # fmt: skip
        assert refused.status_code in (400, 404, 422)
        page = await http.get("/admin/requests")
        assert page.status_code == 200
        assert 'href="/admin/requests"' in page.text  # in the navigation
        ids = ROW_ID.findall(page.text)
        assert len(ids) == 50 and ids[0] == refused.headers["x-request-id"]
        assert ids[1:3] == ["beta-503-1", "beta-503-0"]
        older = re.search(r'href="([^"]+)" rel="next"', page.text)
        assert older is not None
        second = await http.get(older.group(1).replace("&amp;", "&"))
        more = ROW_ID.findall(second.text)
        assert len(more) == 13 and not set(more) & set(ids)  # 63 rows, each once

        beta = await http.get("/admin/requests?tenant=beta&status=5xx")
        assert ROW_ID.findall(beta.text) == ["beta-503-1", "beta-503-0"]
        assert ROW_ID.findall((await http.get("/admin/requests?status=2xx&tenant=beta")).text) == []

        bad = await http.get("/admin/requests?status=7xx&since=never")
        assert bad.status_code == 400
        assert 'id="f-status-help"' in bad.text and 'id="f-since-help"' in bad.text
        assert "status must be a class" in bad.text
        missing = await http.get("/admin/requests?tenant=nobody")
        assert missing.status_code == 400 and 'id="f-tenant-help"' in missing.text

        one = await http.get("/admin/requests/beta-503-0")
        assert one.status_code == 200
        assert (
            "&lt;script&gt;alert(1)&lt;/script&gt;" in one.text and "<script>alert" not in one.text
        )
        assert "&lt;b&gt;no&lt;/b&gt;" in one.text
        plain = await http.get("/admin/requests/acme-200-0")
        assert "has not opted in" in plain.text
        assert (await http.get("/admin/requests/nothing-here")).status_code == 404

        export = await http.get("/admin/requests.csv?tenant=acme")
        assert export.status_code == 200 and export.headers["content-type"].startswith("text/csv")
        table = list(csv.DictReader(io.StringIO(export.text)))
        assert len(table) == 61 and {row["tenant"] for row in table} == {"acme"}
