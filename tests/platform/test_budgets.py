"""Budgets through the API: a tenant's 2,000-token daily budget spent through the official
``openai`` client is refused with 429 ``budget_exceeded`` (the budget, what it used, when it
resets, ``Retry-After``), on one server and across two replicas on one database; requests in
flight when it is reached finish and are charged; key budgets, cost budgets from the price
table, soft-limit crossings recorded once, the tenant's own view and the admin API's checks."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import openai
import pytest
from sqlalchemy import func, select

from loraplex.platform.db.models import AuditEvent, BudgetAlert, Tenant
from tests.utils.tenancy import TenancyEnv, bearer

pytestmark = pytest.mark.anyio

MESSAGES: list[Any] = [{"role": "user", "content": "t30 t31"}]


def _client(env: TenancyEnv, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        api_key=key, base_url="http://test/v1", http_client=env.http, max_retries=0
    )


async def _budget(env: TenancyEnv, tenant: str, **fields: Any) -> dict[str, Any]:
    body = {"metric": "tokens", "period": "day", **fields}
    r = await env.http.post(
        f"/admin/api/tenants/{tenant}/budgets", headers=env.admin_headers, json=body
    )
    assert r.status_code == 201, r.text
    result: dict[str, Any] = r.json()
    return result


async def _charged(envs: list[TenancyEnv]) -> None:
    """Every replica's budgeted usage rows are in the database (they land a few ms after a
    response; another replica reads them from then on)."""
    for env in envs:
        assert env.app.platform.tenancy is not None
        await env.app.platform.tenancy.budgets.close()


async def _chat(client: openai.AsyncOpenAI, max_tokens: int) -> Any:
    return await client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=max_tokens
    )


def _next_midnight() -> dt.datetime:
    now = dt.datetime.now(dt.timezone.utc)
    return (now + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)


async def _spend_until_refused(
    envs: list[TenancyEnv], key: str, max_tokens: int = 50, *, settle: bool = True
) -> tuple[list[int], openai.RateLimitError, list[dict[str, str]]]:
    """Requests one after another (alternating between ``envs``) until one is refused;
    returns each served request's total tokens, the refusal and the served ones' headers.
    ``settle``: wait for every replica's charges between requests (another replica sees a
    charge once it commits; a replica's own next admission waits for it)."""
    clients = [_client(env, key) for env in envs]
    sizes: list[int] = []
    headers: list[dict[str, str]] = []
    for i in range(100):
        try:
            raw = await _chat(clients[i % len(clients)], max_tokens)
        except openai.RateLimitError as error:
            return sizes, error, headers
        chat = raw.parse()
        assert chat.usage is not None
        sizes.append(chat.usage.total_tokens)
        headers.append(dict(raw.headers))
        if settle:
            await _charged(envs)
    raise AssertionError("the budget never refused")


def _check_refusal(error: openai.RateLimitError, used: int) -> None:
    body = error.body
    assert isinstance(body, dict)
    assert body["code"] == "budget_exceeded" and body["type"] == "budget"
    midnight = _next_midnight()
    stamp = midnight.isoformat().replace("+00:00", "Z")
    message = body["message"]
    assert "daily token budget of tenant 'acme'" in message
    assert f"{used:,} tokens used of 2,000 tokens" in message and stamp in message
    headers = error.response.headers
    wait = (midnight - dt.datetime.now(dt.timezone.utc)).total_seconds()
    assert abs(int(headers["Retry-After"]) - wait) <= 5
    assert headers["x-budget-reset-at"] == stamp
    assert headers["x-ratelimit-remaining-budget-tokens"] == "0"
    assert headers["x-ratelimit-limit-budget-tokens"] == "2000"


async def _used(env: TenancyEnv, key: str) -> dict[str, Any]:
    r = await env.http.get("/v1/budgets", headers=bearer(key))
    assert r.status_code == 200, r.text
    (budget,) = r.json()["data"]
    return dict(budget)


async def test_a_daily_token_budget_refuses_the_request_after_it_is_spent(
    tenancy: TenancyEnv,
) -> None:
    key = tenancy.tenant("acme")
    await _budget(tenancy, "acme", limit=2000, soft_percent=50)
    # No waiting between requests: each admission waits for this server's earlier charges.
    sizes, error, headers = await _spend_until_refused([tenancy], key, settle=False)
    # Admitted while under the limit; the last one crossed it and finished.
    assert sum(sizes[:-1]) < 2000 <= sum(sizes)
    _check_refusal(error, sum(sizes))
    remaining = [int(h["x-ratelimit-remaining-budget-tokens"]) for h in headers]
    assert remaining == [2000 - sum(sizes[:i]) for i in range(len(sizes))]
    assert {h["x-ratelimit-limit-budget-tokens"] for h in headers} == {"2000"}
    # The tenant's view and its usage agree with what the responses said.
    budget = await _used(tenancy, key)
    assert budget["used"] == sum(sizes) and budget["exceeded"] and budget["remaining"] == 0
    assert budget["resets_at"] == _next_midnight().isoformat().replace("+00:00", "Z")
    usage = await tenancy.http.get("/v1/usage", headers=bearer(key))
    assert usage.json()["totals"]["total_tokens"] == sum(sizes)
    # Refused requests are not charged: the next one is refused with the same figures.
    with pytest.raises(openai.RateLimitError) as again:
        await _chat(_client(tenancy, key), 1)
    _check_refusal(again.value, sum(sizes))
    # Refused before any work: a request too long for the context (a 400 once tokenized) and
    # one with a constraint to compile get the budget's 429, and the engine sees neither.
    submitted = len(tenancy.fake.submitted)
    with pytest.raises(openai.RateLimitError) as early:
        await _chat(_client(tenancy, key), 1000)
    assert early.value.code == "budget_exceeded"
    with pytest.raises(openai.RateLimitError) as early:
        await _client(tenancy, key).chat.completions.create(
            model="tiny-chat", messages=MESSAGES, max_tokens=5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "object"}}},
        )  # fmt: skip
    assert early.value.code == "budget_exceeded"
    assert len(tenancy.fake.submitted) == submitted
    # Soft (50 %) and hard crossings were recorded once each, with their audit events.
    with tenancy.store.db.session() as session:
        levels = sorted(session.scalars(select(BudgetAlert.level)))
        actions = sorted(
            session.scalars(select(AuditEvent.action).where(AuditEvent.action.like("budget.%l%")))
        )
    assert levels == ["hard", "soft"]
    assert actions == ["budget.hard_limit_reached", "budget.soft_limit_crossed"]


async def test_the_budget_holds_across_two_replicas(replicas: list[TenancyEnv]) -> None:
    a, b = replicas
    key = a.tenant("acme")
    await _budget(a, "acme", limit=2000)
    sizes, error, headers = await _spend_until_refused(replicas, key)
    assert len(a.fake.submitted) > 0 and len(b.fake.submitted) > 0  # both served
    assert sum(sizes[:-1]) < 2000 <= sum(sizes)
    _check_refusal(error, sum(sizes))
    # Each admission saw every earlier charge, whichever replica took it.
    remaining = [int(h["x-ratelimit-remaining-budget-tokens"]) for h in headers]
    assert remaining == [2000 - sum(sizes[:i]) for i in range(len(sizes))]
    for env in replicas:  # refused on both
        with pytest.raises(openai.RateLimitError) as refused:
            await _chat(_client(env, key), 1)
        _check_refusal(refused.value, sum(sizes))
        assert (await _used(env, key))["used"] == sum(sizes)
    # Back to back, without waiting: a replica sees the other's charge once it commits (a few
    # ms after the response), its own before its next admission; so at most the other's last
    # request is not yet counted, and the budget is exceeded by at most two requests.
    key = a.tenant("globex")
    await _budget(a, "globex", limit=2000)
    sizes, error, _ = await _spend_until_refused(replicas, key, settle=False)
    assert error.code == "budget_exceeded"
    assert sum(sizes[:-2]) < 2000 <= sum(sizes) < 2000 + 2 * max(sizes)


async def test_requests_in_flight_when_the_budget_is_reached_finish(
    replicas: list[TenancyEnv],
) -> None:
    a, b = replicas
    key = a.tenant("globex")
    await _budget(a, "globex", limit=2000)
    clients = [_client(a, key), _client(b, key)]
    used = 0
    while used < 1800:  # one after another, to near the limit
        raw = await _chat(clients[used % 2], 50)
        used += raw.parse().usage.total_tokens
        await _charged(replicas)
    for env in replicas:
        env.fake.step_delay = 0.01
    # Six at once on both replicas: each is admitted (under the limit when it starts), each
    # finishes and is charged, together well past the limit.
    burst = await asyncio.gather(*[_chat(clients[i % 2], 50) for i in range(6)])
    sizes = [raw.parse().usage.total_tokens for raw in burst]
    await _charged(replicas)
    budget = await _used(a, key)
    assert budget["used"] == used + sum(sizes) > 2000
    assert budget["used"] <= 2000 + sum(sizes)  # over by at most what was in flight
    for client in clients:  # the next one is refused, on either replica
        with pytest.raises(openai.RateLimitError) as refused:
            await _chat(client, 1)
        assert refused.value.code == "budget_exceeded"


async def test_a_key_budget_limits_only_that_key(tenancy: TenancyEnv) -> None:
    limited = tenancy.tenant("acme")
    other = tenancy.tenant("acme")
    keys = await tenancy.http.get("/admin/api/tenants/acme/keys", headers=tenancy.admin_headers)
    ids = [k["id"] for k in keys.json()["data"]]
    public_id = next(i for i in ids if i in limited)
    budget = await _budget(tenancy, "acme", key=public_id, limit=150)
    assert budget["scope"] == "key" and budget["key"] == public_id
    sizes, error, _ = await _spend_until_refused([tenancy], limited, max_tokens=50)
    assert error.code == "budget_exceeded"
    assert f"key '{public_id}' of tenant 'acme'" in str(error.body["message"])  # type: ignore[index]
    ok = await _chat(_client(tenancy, other), 50)  # the tenant's other key is not limited
    assert ok.http_response.status_code == 200
    assert "x-ratelimit-limit-budget-tokens" not in ok.headers
    assert (await tenancy.http.get("/v1/budgets", headers=bearer(other))).json()["data"] == []
    assert (await _used(tenancy, limited))["used"] == sum(sizes)


async def test_a_cost_budget_charges_the_price_table(tenancy: TenancyEnv) -> None:
    key = tenancy.tenant("acme")
    admin = tenancy.admin_headers
    price = {"prompt_per_million": 1000.0, "completion_per_million": 2000.0}
    r = await tenancy.http.put("/admin/api/prices/models/tiny-chat", headers=admin, json=price)
    assert r.status_code == 200, r.text
    assert r.json()["data"] == [{"kind": "base", "model": "tiny-chat", "tenant": None,
                                 "adapter": None, **price}]  # fmt: skip
    await _budget(tenancy, "acme", metric="cost", period="month", limit=0.2)
    sizes, error, headers = await _spend_until_refused([tenancy], key)
    assert error.code == "budget_exceeded"
    assert "monthly cost budget of tenant 'acme' is spent" in str(error.message)
    assert error.response.headers["x-ratelimit-limit-budget-usd"] == "0.200000"
    assert headers[0]["x-ratelimit-remaining-budget-usd"] == "0.200000"
    budget = await _used(tenancy, key)
    # Each request: its prompt tokens at $1,000 and its 50 completion tokens at $2,000 per million.
    prompts = [size - 50 for size in sizes]
    expected = (sum(prompts) * 1000 + len(sizes) * 50 * 2000) / 1e6
    assert abs(budget["used"] - expected) < 1e-9 and budget["used"] >= 0.2
    r = await tenancy.http.delete("/admin/api/prices/models/tiny-chat", headers=admin)
    assert r.status_code == 200
    for method, url, status in (
        ("DELETE", "/admin/api/prices/models/tiny-chat", 404),  # gone already
        ("PUT", "/admin/api/prices/models/" + "m" * 141, 400),
        ("PUT", "/admin/api/tenants/acme/adapters/nope/price", 404),
        ("PUT", "/admin/api/tenants/nobody/adapters/nope/price", 404),
    ):
        r = await tenancy.http.request(method, url, headers=admin, json=price)
        assert r.status_code == status, (url, r.text)
    bad = {"prompt_per_million": -1, "completion_per_million": 1}
    r = await tenancy.http.put("/admin/api/prices/models/tiny-chat", headers=admin, json=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_per_million"
    ok = await _chat(_client(tenancy, key), 5)  # unpriced: costs nothing, so spent nothing
    assert ok.http_response.status_code == 200


async def test_the_admin_api_checks_budgets_and_a_raised_limit_applies_at_once(
    tenancy: TenancyEnv,
) -> None:
    key = tenancy.tenant("acme")
    admin = tenancy.admin_headers
    path = "/admin/api/tenants/acme/budgets"
    for body, status, param in (
        ({"metric": "tokens", "period": "day", "limit": 10, "requests": 5}, 400, None),
        ({"metric": "requests", "period": "day", "limit": 10}, 400, "metric"),
        ({"metric": "tokens", "period": "hour", "limit": 10}, 400, "period"),
        ({"metric": "tokens", "period": "day", "limit": 0}, 400, "limit"),
        ({"metric": "tokens", "period": "day", "limit": 10, "soft_percent": 120}, 400, None),
        ({"metric": "tokens", "period": "day", "limit": 10, "key": "nokey"}, 404, "key"),
    ):
        r = await tenancy.http.post(path, headers=admin, json=body)
        assert r.status_code == status, (body, r.text)
        if param:
            assert r.json()["error"]["param"] == param, r.text
    r = await tenancy.http.post("/admin/api/tenants/nobody/budgets", headers=admin,
                                json={"metric": "tokens", "period": "day", "limit": 1})  # fmt: skip
    assert r.status_code == 404
    created = await _budget(tenancy, "acme", limit=60)
    await _spend_until_refused([tenancy], key)
    r = await tenancy.http.patch(f"{path}/{created['id']}", headers=admin, json={"limit": 100000})
    assert r.status_code == 200 and r.json()["limit"] == 100000 and not r.json()["exceeded"]
    ok = await _chat(_client(tenancy, key), 5)  # admitted at once on this server
    assert ok.http_response.status_code == 200
    listed = (await tenancy.http.get(path, headers=admin)).json()["data"]
    assert [b["id"] for b in listed] == [created["id"]]
    r = await tenancy.http.delete(f"{path}/{created['id']}", headers=admin)
    assert r.status_code == 200 and r.json() == {"id": str(created["id"]), "object": "budget",
                                                 "deleted": True}  # fmt: skip
    assert (await tenancy.http.delete(f"{path}/{created['id']}", headers=admin)).status_code == 404
    ok = await _chat(_client(tenancy, key), 5)
    assert "x-ratelimit-limit-budget-tokens" not in ok.headers
    # A tenant's key reaches none of it.
    for method, url in (("GET", path), ("POST", path), ("GET", "/admin/api/prices")):
        r = await tenancy.http.request(method, url, headers=bearer(key), json={})
        assert r.status_code in (401, 403), (url, r.status_code)


async def test_a_crossing_is_recorded_once_across_replicas(replicas: list[TenancyEnv]) -> None:
    a = replicas[0]
    key = a.tenant("acme")
    await _budget(a, "acme", limit=100, soft_percent=10)
    heard: list[Any] = []
    managers = [env.app.platform.tenancy.budgets for env in replicas]  # type: ignore[union-attr]
    for manager in managers:
        manager.subscribe(heard.append)
    await _chat(_client(a, key), 20)  # 25 tokens: past 10 %, under 100
    await _charged(replicas)
    assert [e.kind for e in heard] == ["budget.soft_limit_crossed"]
    assert heard[0].tenant_name == "acme" and heard[0].facts["limit"] == 100
    # Both replicas look again at once: nothing new is recorded, nobody hears twice.
    with a.store.db.session() as session:
        tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == "acme"))
    assert tenant_id is not None
    found = [await m.applicable(tenant_id, None) for m in managers]
    results = await asyncio.gather(
        *[m.record_crossings(f) for m, f in zip(managers, found, strict=True)]
    )
    assert results == [[], []] and len(heard) == 1
    with a.store.db.session() as session:
        assert session.scalar(select(func.count()).select_from(BudgetAlert)) == 1


async def test_a_limit_reached_by_requests_side_by_side_is_recorded(tenancy: TenancyEnv) -> None:
    """Two requests admitted together, each under the limit with its own tokens, reach it
    together: neither one's check sees the crossing; the refusal that follows records it."""
    key = tenancy.tenant("acme")
    await _budget(tenancy, "acme", limit=100)
    tenancy.fake.step_delay = 0.01
    client = _client(tenancy, key)
    both = await asyncio.gather(_chat(client, 50), _chat(client, 50))
    assert sum(raw.parse().usage.total_tokens for raw in both) >= 100
    await _charged([tenancy])
    with tenancy.store.db.session() as session:
        assert session.scalar(select(func.count()).select_from(BudgetAlert)) == 0
    with pytest.raises(openai.RateLimitError):
        await _chat(client, 5)
    await _charged([tenancy])
    with tenancy.store.db.session() as session:
        assert list(session.scalars(select(BudgetAlert.level))) == ["hard"]
    with pytest.raises(openai.RateLimitError):  # recorded once
        await _chat(client, 5)
    await _charged([tenancy])
    with tenancy.store.db.session() as session:
        assert session.scalar(select(func.count()).select_from(BudgetAlert)) == 1
