"""The stored request log (issue 34.4): a row per /v1/ request, refused ones too; filters,
cursors stable while rows arrive, one request by id, CSV export, bodies only for a tenant
that opted in (cut at its cap), the retention purge, bounded filter values (400s).

Decided: a 401 for a key whose public id names a key (revoked, expired, a wrong secret) is
logged under that key's tenant; a 401 without a key or with an unknown one is not logged."""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import io
from typing import Any

import pytest
from sqlalchemy import func, select

from loraplex.platform import tenants
from loraplex.platform.db.models import RequestLogEntry, utcnow
from loraplex.platform.request_log import RequestRecord
from loraplex.platform.request_log_writer import RequestLogWriter
from tests.utils.tenancy import bearer

pytestmark = pytest.mark.anyio

MODEL = "tiny-chat"


def _writer(env: Any) -> RequestLogWriter:
    writer = env.app.platform.tenancy.request_log
    assert isinstance(writer, RequestLogWriter)
    return writer


async def _search(env: Any, **params: Any) -> dict[str, Any]:
    r = await env.http.get("/admin/api/requests", params=params, headers=env.admin_headers)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def _complete(env: Any, key: str, model: str = MODEL, **extra: Any) -> Any:
    body = {"model": model, "prompt": "t30 t31", "max_tokens": 3, **extra}
    return await env.http.post("/v1/completions", headers=bearer(key), json=body)


async def test_answered_and_refused_requests_are_listed(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme", quotas=tenants.Quotas(requests_per_minute=1))
    public_id = key.split("_")[1]
    ok = await _complete(env, key)
    assert ok.status_code == 200
    rid = ok.headers["x-request-id"]
    assert rid == ok.json()["id"]
    missing = await _complete(env, key, model="nope")  # 404 model_not_found
    assert missing.status_code == 404
    bad = await env.http.post(
        "/v1/completions", headers=bearer(key), json={"model": MODEL, "max_tokens": -1}
    )
    assert bad.status_code in (400, 422)
    limited = await _complete(env, key)  # the 2nd admitted request of the minute: 429
    assert limited.status_code == 429
    # A wrong secret for a real key: 401, logged under the key's tenant.
    wrong = key[:-4] + ("aaaa" if not key.endswith("aaaa") else "bbbb")
    assert (await _complete(env, wrong)).status_code == 401
    # No key, and a key that names no key: 401, not logged.
    assert (await env.http.post("/v1/completions", json={"model": MODEL})).status_code == 401
    assert (await _complete(env, "lpx_" + "a" * 12 + "_" + "b" * 40)).status_code == 401

    page = await _search(env, tenant="acme")
    rows = page["data"]
    assert [r["status"] for r in rows] == [401, 429, bad.status_code, 404, 200]
    assert all(r["tenant"] == "acme" and r["key"] == public_id for r in rows)
    assert {r["error_code"] for r in rows[:4]} >= {"model_not_found", "invalid_api_key"}
    done = rows[-1]
    assert done["request_id"] == rid and done["served_model"] == MODEL
    assert done["prompt_tokens"] > 0 and done["completion_tokens"] == 3
    assert done["finish_reason"] == "length" and done["ttft_ms"] is not None
    assert done["has_bodies"] is False  # no bodies by default
    assert all(r["request_id"] for r in rows)  # refused requests get an id too
    assert rows[1]["request_id"] == limited.headers["x-request-id"]
    assert (await _search(env))["data"] == rows  # nobody else was logged

    one = await env.http.get(f"/admin/api/requests/{rid}", headers=env.admin_headers)
    assert one.status_code == 200 and one.json()["id"] == done["id"]
    assert one.json()["request_body"] is None
    gone = await env.http.get("/admin/api/requests/req-none", headers=env.admin_headers)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "request_not_found"


async def test_filters(tenancy: Any) -> None:
    env = tenancy
    a1, b1 = env.tenant("acme"), env.tenant("beta")
    a2 = env.tenant("acme")
    for key in (a1, a2, b1):
        assert (await _complete(env, key)).status_code == 200
    assert (await _complete(env, a1, model="nope")).status_code == 404
    by_tenant = await _search(env, tenant="acme")
    assert len(by_tenant["data"]) == 3
    by_key = await _search(env, key=a2.split("_")[1])
    assert len(by_key["data"]) == 1 and by_key["data"][0]["tenant"] == "acme"
    assert len((await _search(env, status="4xx"))["data"]) == 1
    assert len((await _search(env, status="2xx", tenant="acme"))["data"]) == 2
    assert len((await _search(env, status="404"))["data"]) == 1
    assert len((await _search(env, model="nope"))["data"]) == 1
    assert len((await _search(env, model=MODEL))["data"]) == 3
    future = (utcnow() + dt.timedelta(hours=1)).isoformat()
    assert (await _search(env, since=future))["data"] == []
    assert len((await _search(env, until=future))["data"]) == 4
    rid = by_key["data"][0]["request_id"]
    assert [r["request_id"] for r in (await _search(env, request_id=rid))["data"]] == [rid]
    # Unknown tenant: 404, not an empty page hiding a typo.
    r = await env.http.get("/admin/api/requests?tenant=acmee", headers=env.admin_headers)
    assert r.status_code == 404


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("status=6xx", "status"),
        ("status=abc", "status"),
        ("tenant=Not%20A%20Name", "tenant"),
        ("key=has-dash", "key"),
        ("model=" + "m" * 141, "model"),
        ("request_id=" + "r" * 65, "request_id"),
        ("since=yesterday", "since"),
        ("since=2026-01-02&until=2026-01-01", "until"),
        ("cursor=-1", "cursor"),
        ("cursor=abc", "cursor"),
        ("limit=0", "limit"),
        ("limit=501", "limit"),
        ("tenant=" + "a" * 201, "tenant"),
    ],
)
async def test_bad_filters_are_clear_400s(tenancy: Any, query: str, param: str) -> None:
    r = await tenancy.http.get(f"/admin/api/requests?{query}", headers=tenancy.admin_headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert param in error["message"]


async def test_cursor_pages_stay_stable_while_rows_arrive(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme")
    for _ in range(23):
        assert (await _complete(env, key)).status_code == 200
    before = [r["id"] for r in (await _search(env, limit=500))["data"]]
    seen: list[int] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 5}
        if cursor:
            params["cursor"] = cursor
        page = await _search(env, **params)
        seen += [r["id"] for r in page["data"]]
        for _ in range(3):  # new requests while the operator pages
            assert (await _complete(env, key)).status_code == 200
        cursor = page["next_cursor"]
        if not page["has_more"]:
            assert cursor is None
            break
    # The first page may include nothing new (read before the inserts); every later page
    # holds only older rows: each row that existed exactly once, none twice.
    assert len(seen) == len(set(seen))
    assert seen == before
    total = len((await _search(env, limit=500))["data"])
    assert total == 23 + 3 * (len(before) // 5 + 1)


async def test_bodies_only_for_the_opted_in_tenant_and_capped(tenancy: Any) -> None:
    env = tenancy
    acme, beta = env.tenant("acme"), env.tenant("beta")
    r = await env.http.put(
        "/admin/api/tenants/acme/request-log",
        json={"log_bodies": True, "body_max_bytes": 40},
        headers=env.admin_headers,
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "request_log_settings", "tenant": "acme", "log_bodies": True,
                        "body_max_bytes": 40}  # fmt: skip
    got = await env.http.get("/admin/api/tenants/acme/request-log", headers=env.admin_headers)
    assert got.json()["body_max_bytes"] == 40
    a = await _complete(env, acme, user="u" * 100)
    b = await _complete(env, beta)
    a_row = (await env.http.get(f"/admin/api/requests/{a.json()['id']}",
                                headers=env.admin_headers)).json()  # fmt: skip
    b_row = (await env.http.get(f"/admin/api/requests/{b.json()['id']}",
                                headers=env.admin_headers)).json()  # fmt: skip
    assert len(a.request.content) > 100 and len(a.content) > 100
    assert a_row["request_body"].encode() == a.request.content[:40]
    assert a_row["response_body"].encode() == a.content[:40]
    assert b_row["request_body"] is None and b_row["response_body"] is None
    # Off again: no more bodies.
    r = await env.http.put(
        "/admin/api/tenants/acme/request-log", json={"log_bodies": False},
        headers=env.admin_headers,
    )  # fmt: skip
    assert r.json()["log_bodies"] is False
    c = await _complete(env, acme)
    c_row = (await env.http.get(f"/admin/api/requests/{c.json()['id']}",
                                headers=env.admin_headers)).json()  # fmt: skip
    assert c_row["request_body"] is None
    # Bounded and strict.
    for body in ({"log_bodies": True, "body_max_bytes": 0},
                 {"log_bodies": True, "body_max_bytes": 2 * 1024 * 1024},
                 {"log_bodies": True, "max_bytes": 10}):  # fmt: skip
        r = await env.http.put("/admin/api/tenants/acme/request-log", json=body,
                               headers=env.admin_headers)  # fmt: skip
        assert r.status_code == 400, r.text


async def test_csv_export(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme")
    for _ in range(3):
        assert (await _complete(env, key)).status_code == 200
    assert (await _complete(env, key, model="=cmd|' /C calc'!A0")).status_code == 404
    r = await env.http.get("/admin/api/requests.csv", headers=env.admin_headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(r.text)))
    assert len(table) == 4 and table[0]["status"] == "404"
    assert table[0]["model"].startswith("'=")  # never a formula in a spreadsheet
    assert {row["tenant"] for row in table} == {"acme"}
    r = await env.http.get("/admin/api/requests.csv?status=2xx&limit=2",
                           headers=env.admin_headers)  # fmt: skip
    assert len(list(csv.DictReader(io.StringIO(r.text)))) == 2
    r = await env.http.get("/admin/api/requests.csv?limit=100001", headers=env.admin_headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


async def test_retention_purge(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme")
    for _ in range(3):
        assert (await _complete(env, key)).status_code == 200
    writer = _writer(env)
    await writer.flush()
    with env.store.db.session() as session:  # age one row past the 7-day retention
        oldest = session.scalars(select(RequestLogEntry).order_by(RequestLogEntry.id)).first()
        assert oldest is not None
        oldest.created_at = utcnow() - dt.timedelta(days=8)
    # The background upkeep (started by the app's lifespan) purges at once, then hourly.
    task = asyncio.create_task(writer.maintain_forever())
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            with env.store.db.session() as session:
                left = session.scalar(select(func.count()).select_from(RequestLogEntry))
            if left == 2:
                break
        assert left == 2
    finally:
        task.cancel()
    assert await writer.purge() == 0


async def test_full_queue_drops_and_counts(tenancy: Any) -> None:
    env = tenancy
    writer = RequestLogWriter(env.store.db, retention_days=7, max_queue=2)
    record = RequestRecord("POST", "/v1/completions", caller="admin", status=200)
    for _ in range(5):
        writer.observe(record)
    assert writer.pending == 2 and writer.dropped == 3
    assert await writer.flush() == 2
    env.app.platform.tenancy.request_log.dropped = 7
    r = await env.http.get("/metrics", headers=env.admin_headers)
    assert "loraplex_request_log_dropped_total 7.0" in r.text
