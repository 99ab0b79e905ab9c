"""Quotas: requests/minute, tokens/minute and concurrency per tenant, enforced before the engine;
429 with Retry-After and x-ratelimit-*; one tenant's flood leaves another's latency alone."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import httpx
import pytest

from loraplex.platform.auth import Caller
from loraplex.platform.errors import APIError
from loraplex.platform.quotas import (
    Limits,
    QuotaManager,
    Window,
    estimate_tokens,
    format_duration,
    refusal,
)
from loraplex.platform.tenants import Quotas
from tests.utils.request_hooks import wire
from tests.utils.tenancy import bearer

pytestmark = pytest.mark.anyio

TENANT = Caller(id="tenant:acme/key:k", tenant_id="1")
OTHER = Caller(id="tenant:globex/key:k", tenant_id="2")
OPERATOR = Caller(id="admin")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _manager() -> tuple[QuotaManager, Clock]:
    clock = Clock()
    return QuotaManager(None, clock=clock), clock


async def _refused(manager: QuotaManager, caller: Caller, tokens: int, limits: Limits) -> APIError:
    with pytest.raises(APIError) as info:
        await manager.admit(caller, tokens, limits=limits)
    error = info.value
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    return error


# ---- the limiter, on a fake clock ------------------------------------------------------------


async def test_requests_per_minute_is_a_sliding_window() -> None:
    quotas, clock = _manager()
    limits = Limits(requests_per_minute=3, tenant_name="acme")
    for step in range(3):
        lease = await quotas.admit(TENANT, 10, limits=limits)
        assert lease.headers["x-ratelimit-remaining-requests"] == str(2 - step)
        lease.finish(10)
        clock.now += 10  # admitted at 1000, 1010, 1020
    error = await _refused(quotas, TENANT, 10, limits)  # at 1030
    assert error.type == "requests"
    assert error.headers is not None
    assert error.headers["Retry-After"] == "30"  # the request of 1000 leaves at 1060
    assert error.headers["x-ratelimit-limit-requests"] == "3"
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    assert error.headers["x-ratelimit-reset-requests"] == "50s"
    assert "3 requests per minute" in error.message and "30 s" in error.message
    # Refused requests are not counted: the wait does not grow with retries.
    for _ in range(50):
        await _refused(quotas, TENANT, 10, limits)
    await _refused(quotas, OTHER, 10, Limits(requests_per_minute=0))  # limits are per tenant
    assert (await quotas.admit(OTHER, 10, limits=limits)).headers  # ...and so is the window
    clock.now = 1060.0
    (await quotas.admit(TENANT, 10, limits=limits)).finish(10)
    await _refused(quotas, TENANT, 10, limits)


async def test_tokens_per_minute_charges_actual_tokens_and_overshoots_by_one_request_at_most() -> (
    None
):
    quotas, clock = _manager()
    limits = Limits(tokens_per_minute=100)
    first = await quotas.admit(TENANT, 60, limits=limits)  # in flight: 60 reserved
    assert first.headers["x-ratelimit-remaining-tokens"] == "40"
    second = await quotas.admit(TENANT, 60, limits=limits)  # 60 < 100: admitted, may overshoot
    error = await _refused(quotas, TENANT, 1, limits)  # 120 >= 100
    assert error.type == "tokens" and "100 tokens per minute" in error.message
    assert error.headers is not None and error.headers["Retry-After"] == "1"  # held in flight
    clock.now += 5
    first.finish(20)  # the estimate gives way to the actual count
    second.finish(30)
    third = await quotas.admit(TENANT, 10, limits=limits)  # 50 used
    assert third.headers["x-ratelimit-remaining-tokens"] == "40"
    third.finish(60)  # 110 used: over, by this one request
    clock.now += 20
    error = await _refused(quotas, TENANT, 1, limits)
    assert error.headers is not None
    assert error.headers["x-ratelimit-remaining-tokens"] == "0"
    assert error.headers["Retry-After"] == "40"  # the 20 + 30 of t=1005 leave at 1065 (now 1025)
    clock.now = 1065.0
    (await quotas.admit(TENANT, 10, limits=limits)).finish(0)


async def test_tokens_per_minute_never_exceeds_the_limit_by_more_than_one_request() -> None:
    """Random requests and finishes for 10 simulated minutes: in every 60 s window the tokens
    charged stay below limit + the largest single request."""
    quotas, clock = _manager()
    limit, biggest = 1000, 300
    limits = Limits(tokens_per_minute=limit)
    rng = random.Random(0)
    open_leases: list[tuple[float, Any, int]] = []
    charged: list[tuple[float, int]] = []
    end = clock.now + 600
    while clock.now < end:
        clock.now += rng.uniform(0.0, 2.0)
        for item in [x for x in open_leases if x[0] <= clock.now]:
            open_leases.remove(item)
            item[1].finish(item[2])
            charged.append((clock.now, item[2]))
        estimate = rng.randint(1, biggest)
        try:
            lease = await quotas.admit(TENANT, estimate, limits=limits)
        except APIError:
            continue
        open_leases.append((clock.now + rng.uniform(0.1, 20), lease, rng.randint(0, estimate)))
    for t, _ in charged:
        in_window = sum(n for u, n in charged if t - 60 < u <= t)
        assert in_window < limit + biggest
    assert sum(n for _, n in charged) > 5 * limit  # the test did exercise the limit


async def test_concurrency_is_a_counter_released_once_per_lease() -> None:
    quotas, _ = _manager()
    limits = Limits(max_concurrent_requests=2)
    a = await quotas.admit(TENANT, 1, limits=limits)
    b = await quotas.admit(TENANT, 1, limits=limits)
    error = await _refused(quotas, TENANT, 1, limits)
    assert error.type == "requests" and "concurrent" in error.message
    a.finish(1)
    a.finish(1)  # idempotent: frees one slot, not two
    c = await quotas.admit(TENANT, 1, limits=limits)
    await _refused(quotas, TENANT, 1, limits)
    assert quotas.in_flight(1) == 2
    b.finish(1)
    c.finish(1)
    assert quotas.in_flight(1) == 0


async def test_the_operator_is_never_limited() -> None:
    quotas, _ = _manager()
    for _ in range(100):
        lease = await quotas.admit(OPERATOR, 10**9, limits=Limits(0, 0, 0))
        assert lease.headers == {}


def test_reset_durations_use_openais_format() -> None:
    assert [format_duration(s) for s in (0, 0.25, 1, 6.2, 60, 90)] == [
        "0s",
        "250ms",
        "1s",
        "7s",
        "1m0s",
        "1m30s",
    ]


# ---- through the API ---------------------------------------------------------------------------


def _completion(max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-chat", "prompt": "t30 t31", "max_tokens": max_tokens, **extra}


async def _post(env: Any, key: str, body: dict[str, Any]) -> httpx.Response:
    return await env.http.post("/v1/completions", headers=bearer(key), json=body)


def _engine_requests(env: Any) -> int:
    return len(env.fake.submitted)


async def test_flood_gets_429_while_another_tenant_keeps_its_latency(tenancy: Any) -> None:
    env = tenancy
    flooder = env.tenant("flooder", quotas=Quotas(requests_per_minute=5))
    calm = env.tenant("calm", quotas=Quotas(requests_per_minute=1000))
    wire(env)
    env.fake.step_delay = 0.025  # 8 tokens: about 200 ms a request

    async def calm_latencies(count: int) -> list[float]:
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            r = await _post(env, calm, _completion(8))
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
        return times

    await calm_latencies(2)  # warm-up (tokenizer, connections)
    idle = statistics.median(await calm_latencies(6))

    statuses: list[int] = []
    refused: list[httpx.Response] = []
    stop = asyncio.Event()

    async def flood() -> None:
        while not stop.is_set():
            r = await _post(env, flooder, _completion(8))
            statuses.append(r.status_code)
            if r.status_code == 429 and len(refused) < 3:
                refused.append(r)
            await asyncio.sleep(0.005)

    flooders = [asyncio.create_task(flood()) for _ in range(4)]
    try:
        busy = statistics.median(await calm_latencies(6))
    finally:
        stop.set()
        await asyncio.gather(*flooders)

    print(
        f"\nflood: {len(statuses)} requests of the flooding tenant ({statuses.count(200)} "
        f"admitted, {statuses.count(429)} refused with 429); the other tenant's median latency "
        f"{idle * 1000:.0f} ms idle vs {busy * 1000:.0f} ms under the flood "
        f"({busy / idle:.2f}x)"
    )
    assert statuses.count(200) == 5 and statuses.count(429) == len(statuses) - 5
    assert statuses.count(429) >= 20
    assert busy < 2 * idle
    # Refused requests never reached the engine: 2 + 6 + 6 calm ones, 5 of the flooder.
    assert _engine_requests(env) == 14 + 5

    r = refused[0]
    error = r.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "flooder" in error["message"] and "5 requests per minute" in error["message"]
    retry = int(r.headers["Retry-After"])
    assert 1 <= retry <= 60
    assert r.headers["x-ratelimit-limit-requests"] == "5"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-reset-requests"].endswith("s")


async def test_concurrency_limit_over_the_api(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme", quotas=Quotas(max_concurrent_requests=2))
    wire(env)
    env.fake.step_delay = 0.02
    streamed = {**_completion(10), "stream": True}
    results = await asyncio.gather(
        _post(env, key, _completion(8)),
        _post(env, key, streamed),
        *[_post(env, key, _completion(10)) for _ in range(3)],
    )
    statuses = sorted(r.status_code for r in results)
    assert statuses == [200, 200, 429, 429, 429]
    refused = next(r for r in results if r.status_code == 429)
    assert "2 requests in progress" in refused.json()["error"]["message"]
    assert refused.headers["Retry-After"] == "1"
    # Both slots were released when the responses (one of them streamed) ended.
    assert env.app.platform.tenancy.quotas.in_flight(int(_tenant_id(env, "acme"))) == 0
    again = await asyncio.gather(*[_post(env, key, _completion(2)) for _ in range(2)])
    assert [r.status_code for r in again] == [200, 200]


def _tenant_id(env: Any, name: str) -> int:
    from loraplex.platform import tenants

    with env.store.db.session() as session:
        return tenants.require_tenant(session, name).id


async def test_tokens_per_minute_over_the_api(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme", quotas=Quotas(tokens_per_minute=60))
    other = env.tenant("globex", quotas=Quotas(tokens_per_minute=60))
    wire(env)
    sizes = []
    for _ in range(20):
        r = await _post(env, key, _completion(8))
        if r.status_code == 429:
            break
        assert r.status_code == 200, r.text
        sizes.append(r.json()["usage"]["total_tokens"])
    else:
        raise AssertionError("tokens/minute never refused")
    error = r.json()["error"]
    assert error["type"] == "tokens" and "60 tokens per minute" in error["message"]
    assert int(r.headers["Retry-After"]) >= 1
    assert r.headers["x-ratelimit-limit-tokens"] == "60"
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"
    # Admitted while under the limit: the total exceeds it by less than one request.
    assert 60 <= sum(sizes) < 60 + max(sizes)
    assert sum(sizes[:-1]) < 60
    # The other tenant has its own budget.
    assert (await _post(env, other, _completion(8))).status_code == 200


async def test_a_quota_change_applies_on_the_next_request(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme", quotas=Quotas(requests_per_minute=1))
    wire(env)
    assert (await _post(env, key, _completion())).status_code == 200
    assert (await _post(env, key, _completion())).status_code == 429
    r = await env.http.patch(
        "/admin/api/tenants/acme",
        headers=env.admin_headers,
        json={"quotas": {"requests_per_minute": 3}},
    )
    assert r.status_code == 200
    assert (await _post(env, key, _completion())).status_code == 200
    r = await env.http.patch(
        "/admin/api/tenants/acme",
        headers=env.admin_headers,
        json={"quotas": {"requests_per_minute": None}},
    )
    for _ in range(5):
        assert (await _post(env, key, _completion())).status_code == 200


async def test_limits_are_read_from_the_tenant_row_and_cached_briefly(tenancy: Any) -> None:
    env = tenancy
    env.tenant("acme", quotas=Quotas(requests_per_minute=7))
    tenant_id = _tenant_id(env, "acme")
    clock = Clock()
    quotas = QuotaManager(env.store.db, clock=clock, limits_ttl=2.0)
    assert (await quotas.limits(tenant_id)).requests_per_minute == 7
    from loraplex.platform import tenants

    with env.store.db.session() as session:
        row = tenants.require_tenant(session, "acme")
        tenants.update_tenant(session, "admin", row, quotas={"requests_per_minute": 9})
    assert (await quotas.limits(tenant_id)).requests_per_minute == 7  # cached
    clock.now += 2.0
    assert (await quotas.limits(tenant_id)).requests_per_minute == 9


def test_the_estimate_bounds_what_a_request_is_charged() -> None:
    prompts = [[1] * 10, [2] * 60]
    assert estimate_tokens(prompts, 2, 8, 64) == 10 + 2 * 8 + 60 + 2 * 4  # capped by the context
    assert estimate_tokens(prompts, 1, None, 64) == 10 + 54 + 60 + 4  # None: context full


@pytest.mark.parametrize("ahead", [0.0, 0.4, 5.0])
def test_retry_after_never_exceeds_the_window(ahead: float) -> None:
    """An admission newer than ``now`` (another replica's, committed while this one waited for
    the tenant's lock, or a replica whose clock is ahead) still gives a Retry-After within the
    60 s window: one such race showed ``Retry-After: 61``."""
    now = 1000.0
    window = Window(
        requests=30,
        rpm_edge=now + ahead,
        newest_request=now + ahead,
        tokens_used=0,
        newest_tokens=None,
        reserved=0,
        in_flight=0,
        finished=lambda: [],
    )
    error = refusal(window, Limits(requests_per_minute=30), now, 60.0)
    assert error is not None
    assert 1 <= int(error.headers["Retry-After"]) <= 60
    tokens = Window(
        requests=0,
        rpm_edge=None,
        newest_request=None,
        tokens_used=100,
        newest_tokens=now + ahead,
        reserved=0,
        in_flight=0,
        finished=lambda: [(now + ahead, 100)],
    )
    error = refusal(tokens, Limits(tokens_per_minute=100), now, 60.0)
    assert error is not None
    assert 1 <= int(error.headers["Retry-After"]) <= 60
