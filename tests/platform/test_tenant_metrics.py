"""What the scheduler gave each tenant, for the operator (issue 14): ``/metrics`` families by
tenant id (monotonic across engine restarts, gauges only while the engine answers) and the
tenants' counters in ``/admin/api/engine``, with their names."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from loraplex.engine.client import NO_TENANT, TenantStats
from loraplex.platform import tenants
from tests.utils.fakes import FakeEngineClient
from tests.utils.metrics import app_for, http, scrape, value

pytestmark = pytest.mark.anyio


@pytest.fixture
async def api(fake: FakeEngineClient, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with http(app_for(fake, tokenizer)) as client:
        yield client


async def test_per_tenant_service_in_metrics(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    fake.engine_stats = {
        "tenants": {
            "7": TenantStats(12.5, 100, 40, num_running=2, num_waiting=3, weight=3.0),
            NO_TENANT: TenantStats(None, 10, 5),
        }
    }
    m = await scrape(api)
    assert value(m, "loraplex_tenant_prompt_tokens_computed_total", tenant="7") == 100
    assert value(m, "loraplex_tenant_generated_tokens_total", tenant="7") == 40
    assert value(m, "loraplex_tenant_generated_tokens_total", tenant=NO_TENANT) == 5
    assert value(m, "loraplex_tenant_virtual_service", tenant="7") == 12.5
    assert value(m, "loraplex_tenant_requests_running", tenant="7") == 2
    assert value(m, "loraplex_tenant_requests_waiting", tenant="7") == 3
    assert value(m, "loraplex_tenant_weight", tenant="7") == 3.0
    assert ("loraplex_tenant_virtual_service", frozenset({("tenant", NO_TENANT)})) not in m

    # The engine restarted: its counts start from zero, the series go on.
    fake.engine_stats = {"tenants": {"7": TenantStats(1.0, 10, 4)}, "engine_restarts": 1}
    m = await scrape(api)
    assert value(m, "loraplex_tenant_prompt_tokens_computed_total", tenant="7") == 110
    assert value(m, "loraplex_tenant_generated_tokens_total", tenant="7") == 44
    assert value(m, "loraplex_tenant_generated_tokens_total", tenant=NO_TENANT) == 5  # kept

    fake.alive = False  # no answer: the counters stay, the gauges go
    m = await scrape(api)
    assert value(m, "loraplex_tenant_generated_tokens_total", tenant="7") == 44
    assert not [n for (n, _) in m if n == "loraplex_tenant_requests_running"]


async def test_the_engine_page_lists_each_tenants_share_by_name(tenancy: Any) -> None:
    env = tenancy
    env.tenant("acme")
    with env.store.db.session() as session:
        acme = str(tenants.require_tenant(session, "acme").id)
    env.fake.engine_stats = {
        "tenants": {
            acme: TenantStats(3.5, 20, 10, num_running=1, weight=2.0),
            "999": TenantStats(1.0, 1, 1),  # a tenant deleted since
            NO_TENANT: TenantStats(None, 2, 2),
        }
    }
    r = await env.http.get("/admin/api/engine", headers=env.admin_headers)
    assert r.status_code == 200, r.text
    rows = {row["tenant_id"]: row for row in r.json()["tenants"]}
    assert rows[acme] == {
        "tenant_id": acme, "name": "acme", "virtual_service": 3.5,
        "num_prompt_tokens_computed": 20, "num_generated_tokens": 10, "num_running": 1,
        "num_waiting": 0, "weight": 2.0, "adapters": {},
    }  # fmt: skip
    assert rows["999"]["name"] is None and rows[NO_TENANT]["name"] is None
