"""``GET /v1/usage``: a tenant's own usage by day and model (audience "tenant"). A key limited
to a list of models sees only those models' rows, and totals of those (``model_access``)."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Query

from loraplex.platform.access import TenantCaller
from loraplex.platform.deps import StoreDep, UsageDep
from loraplex.platform.model_access import allows
from loraplex.platform.usage import UsageReport, UsageTotals, parse_range, tenant_usage

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
    report: UsageReport = await store.db.run(partial(tenant_usage, tenant_id=tenant_id, days=days))
    if caller.allowed_models is None:
        return report
    return _only_models(report, caller.allowed_models)


def _only_models(report: UsageReport, allowed: tuple[str, ...]) -> UsageReport:
    """``report`` without the rows of models off the key's list, its totals summed again."""
    data = [b for b in report.data if allows(allowed, b.model)]
    totals = UsageTotals(
        requests=sum(b.requests for b in data),
        errors=sum(b.errors for b in data),
        prompt_tokens=sum(b.prompt_tokens for b in data),
        completion_tokens=sum(b.completion_tokens for b in data),
        total_tokens=sum(b.total_tokens for b in data),
    )
    return report.model_copy(update={"data": data, "totals": totals})
