"""The request log against a tenant who sends what a database cannot store: a NUL character in
``model`` (JSON's ``\\u0000``) or in the path (``%00``). PostgreSQL refuses NUL in text, so such
a row failed its batch, which stayed queued in front of every later row, every tenant's: the log
stopped, and the operator's searches (which write the queue first) answered 500. Rows are stored
with U+FFFD in place of each NUL."""

from __future__ import annotations

from typing import Any

import pytest

from tests.utils.tenancy import bearer

pytestmark = pytest.mark.anyio

MODEL = "tiny-chat"


async def test_a_nul_in_a_tenants_request_does_not_stop_the_log(tenancy: Any) -> None:
    env = tenancy
    mallory, alice = env.tenant("mallory"), env.tenant("alice")
    r = await env.http.put(
        "/admin/api/tenants/mallory/request-log",
        headers=env.admin_headers,
        json={"log_bodies": True, "body_max_bytes": 4096},
    )
    assert r.status_code == 200, r.text
    sent = await env.http.post(
        "/v1/completions", headers=bearer(mallory), json={"model": "a\u0000b", "prompt": "t30"}
    )
    assert sent.status_code == 404, sent.text
    path = await env.http.get("/v1/models/a%00b", headers=bearer(mallory))  # a NUL in the path
    assert path.status_code == 404, path.text
    ok = await env.http.post(
        "/v1/completions", headers=bearer(alice), json={"model": MODEL, "prompt": "t30 t31",
                                                        "max_tokens": 2},
    )  # fmt: skip
    assert ok.status_code == 200, ok.text

    r = await env.http.get("/admin/api/requests", headers=env.admin_headers)
    assert r.status_code == 200, r.text
    rows = r.json()["data"]
    by_id = {row["request_id"]: row for row in rows}
    assert by_id[ok.headers["x-request-id"]]["status"] == 200  # alice's row, written
    assert by_id[sent.headers["x-request-id"]]["model"] == "a\ufffdb"
    assert by_id[path.headers["x-request-id"]]["endpoint"] == "/v1/models/a\ufffdb"
