"""``GET /v1/usage``: a tenant's own usage by day and model (audience "tenant")."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Query

from loraplex.platform.access import TenantCaller
from loraplex.platform.deps import StoreDep, UsageDep
from loraplex.platform.usage import UsageReport, parse_range, tenant_usage

router = APIRouter()


@router.get("/v1/usage", response_model=UsageReport)
async def get_usage(
    store: StoreDep,
    recorder: UsageDep,
    caller: TenantCaller,
    start: str | None = Query(None, description="first UTC day, YYYY-MM-DD"),
    end: str | None = Query(None, description="last UTC day, YYYY-MM-DD (included)"),
) -> UsageReport:
    """The caller's tenant's usage by day and model (its own rows only). The operator reads
    every tenant's under /admin/api/usage and /admin/api/tenants/{tenant}/usage."""
    days = parse_range(start, end)
    assert caller.tenant_id is not None  # the tenant audience
    tenant_id = int(caller.tenant_id)
    await recorder.flush()  # read your own writes: the rows still buffered count too
    return await store.db.run(partial(tenant_usage, tenant_id=tenant_id, days=days))
