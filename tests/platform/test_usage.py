"""Usage: a row per request that reached the engine (streamed, not, or abandoned), summing
exactly to what the engine produced; GET /v1/usage; roll-ups and retention."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import func, select

from loraplex.platform import tenants, usage
from loraplex.platform.db.models import (
    Adapter,
    AdapterVersion,
    ApiKey,
    Tenant,
    UsageDaily,
    UsageRecord,
)
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.request_log import RequestRecord
from loraplex.platform.usage import DateRange, UsageRecorder, apply_retention
from tests.utils.asgi import drive_until_disconnect
from tests.utils.request_hooks import count_engine_tokens, wire
from tests.utils.tenancy import ADMIN_TOKEN, bearer

pytestmark = pytest.mark.anyio

MODEL = "tiny-chat"


async def _leave_early(app: Any, path: str, token: str, body: dict[str, Any], leave: Any) -> int:
    """One request through ``app`` whose client disconnects once ``leave(sent)``; returns the
    number of response body chunks it got."""
    auth = ((b"authorization", f"Bearer {token}".encode()),)
    sent = await drive_until_disconnect(app, path, body, leave, auth)
    return sum(1 for m in sent if m.get("body"))


def _salt(env: Any, name: str) -> str:
    with env.store.db.session() as session:
        return f"salt:{tenants.require_tenant(session, name).cache_salt}"


def _rows(env: Any, name: str | None) -> list[UsageRecord]:
    with env.store.db.session() as session:
        if name is None:
            query = select(UsageRecord).where(UsageRecord.tenant_id.is_(None))
            return list(session.scalars(query))
        tenant = tenants.require_tenant(session, name)
        return TenantScope(session, tenant.id).all(UsageRecord)


async def _mixed_load(env: Any, key: str) -> int:
    """Streamed and non-streamed completions and chats, n > 1, a batch, two clients that leave
    early, and a request for a missing model. Returns how many requests reached the engine."""
    http = env.http
    chat = [{"role": "user", "content": "t31 t32"}]
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": "t30 t31", "max_tokens": 5}),
        ("/v1/completions", {"prompt": "t30", "max_tokens": 6, "stream": True,
                             "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 4, "stream": True}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 3, "n": 2}),
        ("/v1/completions", {"prompt": ["t30", "t31 t32 t33"], "max_tokens": 2}),
    ]  # fmt: skip
    for path, body in bodies:
        r = await http.post(path, headers=bearer(key), json={"model": MODEL, **body})
        assert r.status_code == 200, r.text
    r = await http.post(
        "/v1/completions", headers=bearer(key), json={"model": "nope", "prompt": "t30"}
    )
    assert r.status_code == 404

    def chunks(n: int) -> Any:
        return lambda sent: sum(1 for m in sent if m.get("body")) >= n

    streamed = {"model": MODEL, "prompt": "t30", "stream": True, "max_tokens": 40}
    got = await _leave_early(env.app, "/v1/completions", key, streamed, chunks(3))
    assert 3 <= got < 40
    submitted = len(env.fake.submitted)

    def engine_started(_: Any) -> bool:
        return len(env.fake.submitted) > submitted and env.fake.step_delay > 0

    plain = {"model": MODEL, "messages": chat, "max_tokens": 40}
    await _leave_early(env.app, "/v1/chat/completions", key, plain, engine_started)
    return len(bodies) + 2


async def test_usage_rows_add_up_to_what_the_engine_produced(tenancy: Any) -> None:
    env = tenancy
    keys = {"acme": env.tenant("acme"), "globex": env.tenant("globex")}
    wire(env)
    produced, prompts = count_engine_tokens(env.fake)
    env.fake.step_delay = 0.01
    counts = {name: await _mixed_load(env, key) for name, key in keys.items()}
    r = await env.http.post(
        "/v1/completions", headers=bearer(ADMIN_TOKEN), json={"model": MODEL, "prompt": "t30",
                                                              "max_tokens": 3},
    )  # fmt: skip
    assert r.status_code == 200
    await env.app.platform.tenancy.usage.flush()

    for name in keys:
        rows = _rows(env, name)
        salt = _salt(env, name)
        assert len(rows) == counts[name]
        assert sum(r.completion_tokens for r in rows) == produced[salt] > 0
        assert sum(r.prompt_tokens for r in rows) == prompts[salt] > 0
        assert Counter(r.status for r in rows) == {200: counts[name] - 2, 499: 2}
        assert all(r.api_key_id is not None and r.model == MODEL for r in rows)
        assert {r.endpoint for r in rows} == {"/v1/completions", "/v1/chat/completions"}
        assert len({r.request_id for r in rows}) == len(rows)
        assert all(r.latency_ms > 0 for r in rows)
        assert all(r.ttft_ms is not None and r.ttft_ms > 0 for r in rows if r.completion_tokens)

        report = (await env.http.get("/v1/usage", headers=bearer(keys[name]))).json()
        (bucket,) = report["data"]  # one day, one model: this tenant's only
        assert bucket["model"] == MODEL and bucket["requests"] == counts[name]
        assert bucket["completion_tokens"] == produced[salt]
        assert bucket["prompt_tokens"] == prompts[salt]
        assert report["totals"]["total_tokens"] == produced[salt] + prompts[salt]

    (operator_row,) = _rows(env, None)
    assert operator_row.completion_tokens == 3 and operator_row.api_key_id is None

    everyone = (await env.http.get("/admin/api/usage", headers=env.admin_headers)).json()
    by_tenant = {b["tenant"]: b["completion_tokens"] for b in everyone["data"]}
    assert by_tenant == {
        "acme": produced[_salt(env, "acme")],
        "globex": produced[_salt(env, "globex")],
        "-": 3,
    }
    one = (await env.http.get("/admin/api/tenants/acme/usage", headers=env.admin_headers)).json()
    assert one["totals"]["completion_tokens"] == produced[_salt(env, "acme")]


async def test_usage_endpoint_checks_dates_and_callers(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme")
    cases = [
        ({"start": "2025-02-30"}, "start", "invalid_date"),
        ({"end": "yesterday"}, "end", "invalid_date"),
        ({"start": "20250101"}, "start", "invalid_date"),
        ({"start": "2025-03-10", "end": "2025-03-01"}, "start", "invalid_date_range"),
        ({"start": "2020-01-01", "end": "2025-01-01"}, "start", "invalid_date_range"),
    ]
    for params, param, code in cases:
        r = await env.http.get("/v1/usage", headers=bearer(key), params=params)
        assert r.status_code == 400, (params, r.text)
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, code) and error["message"]
    r = await env.http.get(
        "/v1/usage", headers=bearer(key), params={"start": "2025-03-01", "end": "2025-03-01"}
    )
    assert r.status_code == 200 and r.json()["start"] == r.json()["end"] == "2025-03-01"
    r = await env.http.get("/v1/usage", headers=env.admin_headers)  # a tenant route
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_key_required"
    assert "/admin/api" in r.json()["error"]["message"]
    assert (await env.http.get("/v1/usage")).status_code == 401


def _record(tenant_id: int | None, **fields: Any) -> RequestRecord:
    record = RequestRecord("POST", "/v1/completions")
    record.caller = "test"
    record.tenant_id = str(tenant_id) if tenant_id is not None else None
    record.served_model = MODEL
    record.request_id = fields.pop("request_id", "cmpl-x")
    record.generated = True
    record.status = 200
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def _tenant_with_version(env: Any, name: str) -> tuple[int, str, int]:
    """A tenant with a key and adapter "style" version 2: (tenant id, key public id, version)."""
    with env.store.db.session() as session:
        tenant = tenants.create_tenant(session, "admin", name)
        key, _ = tenants.create_key(session, "admin", tenant)
        adapter = TenantScope(session, tenant.id).add(Adapter(name="style", next_version=3))
        session.flush()
        version = AdapterVersion(
            adapter_id=adapter.id, number=2, content_sha256="ab" * 32, status="ready"
        )
        session.add(version)
        session.flush()
        return tenant.id, key.public_id, version.id


async def test_rows_name_only_the_tenants_own_key_and_adapter_version(tenancy: Any) -> None:
    env = tenancy
    acme, acme_key, acme_version = _tenant_with_version(env, "acme")
    _, globex_key, globex_version = _tenant_with_version(env, "globex")
    recorder = UsageRecorder(env.store.db)
    recorder.record_request(
        _record(acme, request_id="mine", completion_tokens=4),
        key_id=acme_key,
        adapter_version_id=acme_version,
    )
    recorder.record_request(
        _record(acme, request_id="theirs", completion_tokens=5),
        key_id=globex_key,
        adapter_version_id=globex_version,
    )
    recorder.record_request(_record(999_999, request_id="gone"), key_id=None)  # no such tenant
    assert await recorder.flush() == 2
    with env.store.db.session() as session:
        rows = {r.request_id: r for r in TenantScope(session, acme).all(UsageRecord)}
        key_id = session.scalar(select(ApiKey.id).where(ApiKey.public_id == acme_key))
        assert session.scalar(select(func.count()).select_from(UsageRecord)) == 2
    assert rows["mine"].model == "style@2" and rows["mine"].adapter_version_id == acme_version
    assert rows["mine"].api_key_id == key_id
    # Another tenant's key and version are not linked to this tenant's row.
    assert rows["theirs"].adapter_version_id is None and rows["theirs"].api_key_id is None
    assert rows["theirs"].model == MODEL


async def test_writes_happen_in_the_background_in_batches(tenancy: Any) -> None:
    env = tenancy
    acme = env.tenant("acme") and _tenant_id(env, "acme")
    recorder = UsageRecorder(env.store.db, flush_interval=0.05, batch_size=4)
    for i in range(10):
        recorder.observe(_record(acme, request_id=f"r{i}", completion_tokens=1))
    # observe did no I/O: the rows are buffered.
    assert recorder.pending == 10 and _count(env) == 0
    for _ in range(200):
        if _count(env) == 10:
            break
        await asyncio.sleep(0.01)
    assert _count(env) == 10 and recorder.pending == 0
    await asyncio.sleep(0.2)
    assert recorder._task is not None and recorder._task.done()  # idle: no task left running
    # Requests that did not reach the engine, or other endpoints, are not rows.
    recorder.observe(_record(acme, generated=False, status=429))
    other = _record(acme)
    other.path = "/v1/models"
    recorder.observe(other)
    recorder.observe(_record(acme, request_id="last"))
    await recorder.close()
    assert _count(env) == 11


def _tenant_id(env: Any, name: str) -> int:
    with env.store.db.session() as session:
        return tenants.require_tenant(session, name).id


def _count(env: Any) -> int:
    with env.store.db.session() as session:
        return int(session.scalar(select(func.count()).select_from(UsageRecord)) or 0)


def _raw(tenant_id: int | None, at: dt.datetime, model: str, prompt: int, done: int,
         status: int = 200) -> UsageRecord:  # fmt: skip
    return UsageRecord(
        tenant_id=tenant_id, model=model, prompt_tokens=prompt, completion_tokens=done,
        status=status, created_at=at,
    )  # fmt: skip


async def test_roll_ups_and_retention_never_double_count(tenancy: Any) -> None:
    env = tenancy
    env.tenant("acme")
    acme = _tenant_id(env, "acme")
    now = dt.datetime(2025, 3, 10, 12, 0, tzinfo=dt.timezone.utc)

    def day(d: int, hour: int = 10) -> dt.datetime:
        return dt.datetime(2025, 3, d, hour, tzinfo=dt.timezone.utc)

    with env.store.db.session() as session:
        session.add_all(
            [
                _raw(acme, day(5, 0), MODEL, 10, 1),
                _raw(acme, day(5, 23), MODEL, 20, 2, status=500),
                _raw(acme, day(6), "style@1", 30, 3, status=499),
                _raw(acme, day(8), MODEL, 40, 4),
                _raw(acme, day(10), MODEL, 50, 5),
                _raw(None, day(5), MODEL, 7, 7),  # the operator's
            ]
        )
    march = DateRange(dt.date(2025, 3, 1), dt.date(2025, 3, 10))

    def report() -> dict[str, Any]:
        result = env.store.db.call(lambda s: usage.tenant_usage(s, acme, march))
        return dict(result.model_dump())

    before = report()
    assert [(b["date"], b["model"], b["requests"], b["errors"]) for b in before["data"]] == [
        (dt.date(2025, 3, 5), MODEL, 2, 1),  # 500 is an error; 499 (client left) is not
        (dt.date(2025, 3, 6), "style@1", 1, 0),
        (dt.date(2025, 3, 8), MODEL, 1, 0),
        (dt.date(2025, 3, 10), MODEL, 1, 0),
    ]

    assert await apply_retention(env.store.db, 3, now=now) == 4  # before March 7
    assert report() == before
    with env.store.db.session() as session:
        assert session.scalar(select(func.count()).select_from(UsageRecord)) == 2
        assert session.scalar(select(func.count()).select_from(UsageDaily)) == 3
    assert await apply_retention(env.store.db, 3, now=now) == 0
    assert report() == before

    # A late row for a rolled-up day joins that day's roll-up (the operator's too).
    with env.store.db.session() as session:
        session.add_all([_raw(acme, day(5, 12), MODEL, 1, 1), _raw(None, day(5), MODEL, 1, 1)])
    assert await apply_retention(env.store.db, 3, now=now) == 2
    after = report()
    assert after["data"][0]["requests"] == 3 and after["data"][0]["prompt_tokens"] == 31
    assert after["totals"]["requests"] == before["totals"]["requests"] + 1
    with env.store.db.session() as session:
        operator_days = list(
            session.scalars(select(UsageDaily).where(UsageDaily.tenant_id.is_(None)))
        )
        assert [(d.requests, d.prompt_tokens) for d in operator_days] == [(2, 8)]

    # Deleting the tenant deletes its usage, raw and rolled up.
    with env.store.db.session() as session:
        tenants.delete_tenant(session, "admin", session.get(Tenant, acme))
    with env.store.db.session() as session:
        assert session.scalar(select(func.count()).select_from(UsageDaily)) == 1


async def test_the_app_lifespan_flushes_usage_at_shutdown(tenancy: Any) -> None:
    env = tenancy
    env.tenant("acme")
    acme = _tenant_id(env, "acme")
    recorder: UsageRecorder = env.app.platform.tenancy.usage
    recorder.flush_interval = 3600.0  # only the shutdown writes
    async with env.app.router.lifespan_context(env.app):
        recorder.observe(_record(acme, request_id="at-shutdown", completion_tokens=2))
        await asyncio.sleep(0.05)
        assert _count(env) == 0
    assert _count(env) == 1


async def test_a_failing_tenant_does_not_lose_the_others_rows(
    tenancy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant deleted while its rows were being written (the insert's foreign key fails):
    the batch is retried tenant by tenant and only that tenant's rows are dropped."""
    from sqlalchemy.exc import IntegrityError

    env = tenancy
    env.tenant("acme")
    acme = _tenant_id(env, "acme")
    write = usage._write_rows

    def racing(session: Any, batch: list[Any]) -> int:
        if any(r.tenant_id == 424242 for r in batch):
            raise IntegrityError("INSERT", {}, Exception("FOREIGN KEY constraint failed"))
        return write(session, batch)

    monkeypatch.setattr(usage, "_write_rows", racing)
    recorder = UsageRecorder(env.store.db)
    recorder.record_request(_record(acme, request_id="a1"))
    recorder.record_request(_record(424242, request_id="gone"))
    recorder.record_request(_record(acme, request_id="a2"))
    assert await recorder.flush() == 2
    assert recorder.pending == 0 and _count(env) == 2
