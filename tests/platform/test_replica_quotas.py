"""Quotas across platform replicas: one tenant's requests/minute, tokens/minute and concurrency
hold across two replicas on one database, usage rows of both add up, a dead replica's leases
expire; and the database store keeps the memory store's rules (same fake-clock scenarios)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from loraplex.platform.auth import Caller
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import QuotaLease, UsageRecord
from loraplex.platform.errors import APIError
from loraplex.platform.quota_db import DatabaseQuotaStore
from loraplex.platform.quotas import Limits, MemoryQuotaStore, QuotaManager, QuotaStore
from loraplex.platform.tenants import Quotas
from tests.utils.tenancy import TenancyEnv, bearer, platform_for

pytestmark = pytest.mark.anyio

TENANT = Caller(id="tenant:acme/key:k", tenant_id="1")


def _completion(max_tokens: int = 4) -> dict[str, Any]:
    return {"model": "tiny-chat", "prompt": "t30 t31", "max_tokens": max_tokens}


async def _post(env: TenancyEnv, key: str, max_tokens: int = 4) -> httpx.Response:
    return await env.http.post("/v1/completions", headers=bearer(key), json=_completion(max_tokens))


async def _settle(envs: list[TenancyEnv]) -> None:
    """Every replica's lease releases are in the database (they land a few ms after a
    response; another replica reads them from then on)."""
    for env in envs:
        assert env.app.platform.tenancy is not None
        await env.app.platform.tenancy.quotas.store.close()


def _usage_rows(env: TenancyEnv) -> list[UsageRecord]:
    with env.store.db.session() as session:
        return list(session.scalars(select(UsageRecord).where(UsageRecord.tenant_id.is_not(None))))


async def test_rpm_holds_across_two_replicas_and_usage_rows_add_up(
    replicas: list[TenancyEnv],
) -> None:
    a, b = replicas
    for env in replicas:
        assert isinstance(env.app.platform.tenancy.quotas.store, DatabaseQuotaStore)
    key = a.tenant("acme", quotas=Quotas(requests_per_minute=30))
    # 44 requests at once, alternating between the replicas.
    results = await asyncio.gather(*[_post((a, b)[i % 2], key) for i in range(44)])
    statuses = [r.status_code for r in results]
    assert statuses.count(200) == 30 and statuses.count(429) == 14, statuses
    refused = [r for r in results if r.status_code == 429]
    for r in refused:
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(r.headers["Retry-After"]) <= 60
        assert r.headers["x-ratelimit-limit-requests"] == "30"
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
    served = [r for r in results if r.status_code == 200]
    assert {r.headers["x-ratelimit-remaining-requests"] for r in served} == {
        str(n) for n in range(30)
    }  # each admission saw every earlier one, whichever replica took it
    assert sum(len(env.fake.submitted) for env in replicas) == 30
    assert len(a.fake.submitted) > 0 and len(b.fake.submitted) > 0
    for env in replicas:
        await env.app.platform.tenancy.usage.flush()
    rows = _usage_rows(a)
    assert len(rows) == 30 and {r.status for r in rows} == {200}  # refusals are not usage
    charged = sum(r.json()["usage"]["total_tokens"] for r in served)
    assert sum(r.prompt_tokens + r.completion_tokens for r in rows) == charged


async def test_tpm_and_concurrency_hold_across_two_replicas(replicas: list[TenancyEnv]) -> None:
    a, b = replicas
    key = a.tenant("acme", quotas=Quotas(tokens_per_minute=60))
    sizes = []
    for i in range(20):
        r = await _post((a, b)[i % 2], key, 8)
        await _settle(replicas)
        if r.status_code == 429:
            break
        assert r.status_code == 200, r.text
        sizes.append(r.json()["usage"]["total_tokens"])
    else:
        raise AssertionError("tokens/minute never refused")
    assert r.json()["error"]["type"] == "tokens"
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"
    assert 60 <= sum(sizes) < 60 + max(sizes) and sum(sizes[:-1]) < 60

    key = a.tenant("globex", quotas=Quotas(max_concurrent_requests=2))
    for env in replicas:
        env.fake.step_delay = 0.02
    results = await asyncio.gather(*[_post((a, b)[i % 2], key, 10) for i in range(6)])
    assert sorted(r.status_code for r in results) == [200, 200, 429, 429, 429, 429]
    refused = next(r for r in results if r.status_code == 429)
    assert "2 requests in progress" in refused.json()["error"]["message"]
    await _settle(replicas)
    again = await asyncio.gather(_post(a, key, 2), _post(b, key, 2))
    assert [r.status_code for r in again] == [200, 200]


async def test_a_dead_replicas_leases_expire_and_free_concurrency(
    shared_url: str, tmp_path: Path
) -> None:
    store = platform_for(tmp_path, database_url=shared_url)
    try:
        env_tenant = _make_tenant(store.db)
        caller = Caller(id="tenant:acme/key:k", tenant_id=str(env_tenant))
        clock = _Clock()
        limits = Limits(max_concurrent_requests=1, tenant_name="acme")
        dead = QuotaManager(None, store=DatabaseQuotaStore(store.db, lease_ttl=30, clock=clock))
        live_store = DatabaseQuotaStore(store.db, lease_ttl=30, clock=clock)
        live = QuotaManager(None, store=live_store)
        await dead.admit(caller, 5, limits=limits)  # never finished: its replica died
        error = await _refused(live, caller, limits)
        assert "1 requests in progress" in error.message
        clock.now += 29
        await _refused(live, caller, limits)
        clock.now += 2  # the dead replica renewed nothing: its lease expired at +30
        lease = await live.admit(caller, 5, limits=limits)
        clock.now += 20
        store.db.call(live_store.heartbeat)  # a live replica keeps its own lease on
        await _refused(live, caller, limits)
        lease.finish(5)
        await live_store.close()
        clock.now += 61
        assert store.db.call(live_store.prune) == 2  # both rows left every window
        with store.db.session() as session:
            assert session.scalar(select(func.count()).select_from(QuotaLease)) == 0
    finally:
        store.db.dispose()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _make_tenant(db: Database) -> int:
    from loraplex.platform import tenants

    with db.session() as session:
        return tenants.create_tenant(session, "admin", "acme", quotas=tenants.Quotas()).id


async def _refused(
    manager: QuotaManager, caller: Caller, limits: Limits, tokens: int = 1
) -> APIError:
    with pytest.raises(APIError) as info:
        await manager.admit(caller, tokens, limits=limits)
    assert info.value.status == 429
    return info.value


# ---- the memory store's rules, on both stores --------------------------------------------------

STORES = ["memory", "database"]


@pytest.fixture(params=STORES)
async def manager(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[QuotaManager, _Clock, Caller]]:
    clock = _Clock()
    if request.param == "memory":
        yield QuotaManager(None, store=MemoryQuotaStore(clock=clock)), clock, TENANT
        return
    store = platform_for(tmp_path)  # SQLite; the PostgreSQL half runs through the API above
    tenant_id = _make_tenant(store.db)
    quota_store: QuotaStore = DatabaseQuotaStore(store.db, clock=clock)
    try:
        yield QuotaManager(None, store=quota_store), clock, Caller(id="t", tenant_id=str(tenant_id))
    finally:
        await quota_store.close()
        store.db.dispose()


async def test_requests_per_minute_is_a_sliding_window_on_each_store(
    manager: tuple[QuotaManager, _Clock, Caller],
) -> None:
    quotas, clock, caller = manager
    limits = Limits(requests_per_minute=3, tenant_name="acme")
    for step in range(3):
        lease = await quotas.admit(caller, 10, limits=limits)
        assert lease.headers["x-ratelimit-remaining-requests"] == str(2 - step)
        assert lease.headers["x-ratelimit-reset-requests"] == "1m0s"
        lease.finish(10)
        clock.now += 10
    error = await _refused(quotas, caller, limits, 10)
    assert error.headers is not None
    assert error.headers["Retry-After"] == "30"
    assert error.headers["x-ratelimit-reset-requests"] == "50s"
    assert "3 requests per minute" in error.message
    clock.now = 1060.0
    (await quotas.admit(caller, 10, limits=limits)).finish(10)
    await _refused(quotas, caller, limits, 10)


async def test_tokens_per_minute_charges_actual_tokens_on_each_store(
    manager: tuple[QuotaManager, _Clock, Caller],
) -> None:
    quotas, clock, caller = manager
    limits = Limits(tokens_per_minute=100)
    first = await quotas.admit(caller, 60, limits=limits)
    assert first.headers["x-ratelimit-remaining-tokens"] == "40"
    second = await quotas.admit(caller, 60, limits=limits)
    error = await _refused(quotas, caller, limits)
    assert error.type == "tokens" and error.headers is not None
    assert error.headers["Retry-After"] == "1"  # held in flight
    clock.now += 5
    first.finish(20)
    second.finish(30)
    await quotas.store.close()
    third = await quotas.admit(caller, 10, limits=limits)
    assert third.headers["x-ratelimit-remaining-tokens"] == "40"
    third.finish(60)
    await quotas.store.close()
    clock.now += 20
    error = await _refused(quotas, caller, limits)
    assert error.headers is not None
    assert error.headers["x-ratelimit-remaining-tokens"] == "0"
    assert error.headers["Retry-After"] == "40"
    clock.now = 1065.0
    (await quotas.admit(caller, 10, limits=limits)).finish(0)


async def test_concurrency_is_released_once_per_lease_on_each_store(
    manager: tuple[QuotaManager, _Clock, Caller],
) -> None:
    quotas, _, caller = manager
    limits = Limits(max_concurrent_requests=2)
    a = await quotas.admit(caller, 1, limits=limits)
    b = await quotas.admit(caller, 1, limits=limits)
    error = await _refused(quotas, caller, limits)
    assert "concurrent" in error.message
    a.finish(1)
    a.finish(1)  # idempotent
    c = await quotas.admit(caller, 1, limits=limits)
    await _refused(quotas, caller, limits)
    tenant_id = int(caller.tenant_id or 0)
    assert quotas.in_flight(tenant_id) == 2
    b.finish(1)
    c.finish(1)
    assert quotas.in_flight(tenant_id) == 0
