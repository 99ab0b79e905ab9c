"""Budgets and prices over HTTP.

Operator (audience "operator", ``/admin/api``)::

    GET    /tenants/{tenant}/budgets               every budget of the tenant and its keys, with
    POST   /tenants/{tenant}/budgets               what each used, its limit and when it resets
    PATCH  /tenants/{tenant}/budgets/{budget_id}
    DELETE /tenants/{tenant}/budgets/{budget_id}
    GET    /prices                                 the price table
    PUT    /prices/models/{name}                   a base model's price (by its served name)
    DELETE /prices/models/{name}
    PUT    /tenants/{tenant}/adapters/{ref}/price  an adapter's price (every version)
    DELETE /tenants/{tenant}/adapters/{ref}/price

Tenant (audience "tenant"): ``GET /v1/budgets``, the budgets that apply to the calling key (its
tenant's and its own), with what they used and when they reset.

Every change writes its audit event in the same transaction and takes effect on this replica's
next request (other replicas' within ``budget_manager.RULES_TTL_S``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field, StrictFloat, StrictInt
from sqlalchemy.orm import Session

from loraplex.platform import budget_admin, tenants
from loraplex.platform.access import TenantCaller, operator_caller
from loraplex.platform.api.bodies import StrictBody
from loraplex.platform.auth import Caller
from loraplex.platform.budget_manager import BudgetManager
from loraplex.platform.budgets import BudgetStatus, iso
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.deps import TenancyDep
from loraplex.platform.errors import NOT_FOUND, APIError

operator_router = APIRouter(prefix="/admin/api", tags=["admin"])
tenant_router = APIRouter(tags=["usage"])
operator = Depends(operator_caller)

Number = StrictInt | StrictFloat
MAX_MODEL_NAME = 140  # model_prices.base_model


def _budgets(tenancy: TenancyDep) -> BudgetManager:
    return tenancy.budgets


BudgetsDep = Annotated[BudgetManager, Depends(_budgets)]


# ---- bodies and views --------------------------------------------------------------------------


class BudgetCreate(StrictBody):
    """A budget of the tenant, or of one of its keys (``key``: its public id)."""

    key: str | None = Field(None, max_length=32, description="a key's public id; null: tenant")
    metric: str = Field(description="tokens | cost (US dollars, from the price table)")
    period: str = Field(description="day | week | month")
    anchor: str = Field("calendar", description="calendar (UTC) | rolling")
    limit: Number = Field(description="tokens, or dollars for a cost budget")
    soft_percent: Number | None = Field(None, description="alert at this share of the limit")
    prompt_weight: Number = 1.0
    completion_weight: Number = 1.0


class BudgetUpdate(StrictBody):
    """The fields given change; the scope (tenant or key) does not."""

    metric: str | None = None
    period: str | None = None
    anchor: str | None = None
    limit: Number | None = None
    soft_percent: Number | None = None
    prompt_weight: Number | None = None
    completion_weight: Number | None = None


class PriceBody(StrictBody):
    prompt_per_million: Number = Field(description="US dollars per million prompt tokens")
    completion_per_million: Number = Field(description="US dollars per million completion tokens")


class BudgetView(BaseModel):
    id: int
    object: str = "budget"
    scope: str  # "tenant" | "key"
    key: str | None
    metric: str
    period: str
    anchor: str
    limit: float
    soft_percent: float | None
    prompt_weight: float
    completion_weight: float
    used: float
    remaining: float
    percent_used: float
    window_start: str
    resets_at: str | None
    exceeded: bool
    soft_limit_crossed: bool

    @classmethod
    def of(cls, state: BudgetStatus) -> BudgetView:
        rule = state.rule
        return cls(
            id=rule.id,
            scope=rule.scope,
            key=rule.key_public_id,
            metric=rule.metric,
            period=rule.period,
            anchor=rule.anchor,
            limit=rule.limit,
            soft_percent=rule.soft_percent,
            prompt_weight=rule.prompt_weight,
            completion_weight=rule.completion_weight,
            used=round(state.used, 6),
            remaining=round(state.remaining, 6),
            percent_used=round(100.0 * state.fraction, 2),
            window_start=iso(state.start),
            resets_at=iso(state.resets_at) if state.resets_at is not None else None,
            exceeded=state.exceeded,
            soft_limit_crossed=state.soft_crossed,
        )


class BudgetList(BaseModel):
    object: str = "list"
    data: list[BudgetView]


class PriceView(BaseModel):
    kind: str
    model: str
    tenant: str | None
    adapter: str | None
    prompt_per_million: float
    completion_per_million: float


class PriceList(BaseModel):
    object: str = "list"
    data: list[PriceView]


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool = True


# ---- the operator's budgets ------------------------------------------------------------------


def _budget_number(budget_id: str) -> int:
    """A budget id from the path (a path that is no number names no budget: 404)."""
    if not budget_id.isascii() or not budget_id.isdigit() or len(budget_id) > 12:
        raise APIError(
            404,
            f"There is no budget {budget_id[:40]!r}; budget ids are the numbers GET "
            "/admin/api/tenants/{tenant}/budgets lists.",
            type=NOT_FOUND,
            code="budget_not_found",
        )
    return int(budget_id)


async def _tenant_id(tenancy: TenancyDep, name: str) -> int:
    tenant_id: int = await tenancy.store.db.run(lambda s: tenants.require_tenant(s, name).id)
    return tenant_id


async def _views(budgets: BudgetManager, tenant_id: int, only: int | None = None) -> BudgetList:
    _, states = await budgets.tenant_statuses(tenant_id, every_key=True)
    return BudgetList(data=[BudgetView.of(s) for s in states if only in (None, s.rule.id)])


@operator_router.get("/tenants/{tenant}/budgets", response_model=BudgetList)
async def list_budgets(
    tenancy: TenancyDep, budgets: BudgetsDep, tenant: str, caller: Caller = operator
) -> BudgetList:
    return await _views(budgets, await _tenant_id(tenancy, tenant))


@operator_router.post("/tenants/{tenant}/budgets", response_model=BudgetView, status_code=201)
async def create_budget(
    tenancy: TenancyDep,
    budgets: BudgetsDep,
    tenant: str,
    body: BudgetCreate,
    caller: Caller = operator,
) -> BudgetView:
    def create(session: Session) -> tuple[int, int]:
        row = tenants.require_tenant(session, tenant)
        fields = body.model_dump(exclude={"key"})
        budget, _ = budget_admin.create_budget(
            session, caller.id, row, key_public_id=body.key, **fields
        )
        return row.id, budget.id

    tenant_id, budget_id = await tenancy.store.db.run(create)
    budgets.invalidate(tenant_id)
    return (await _views(budgets, tenant_id, budget_id)).data[0]


@operator_router.patch("/tenants/{tenant}/budgets/{budget_id}", response_model=BudgetView)
async def update_budget(
    tenancy: TenancyDep,
    budgets: BudgetsDep,
    tenant: str,
    budget_id: str,
    body: BudgetUpdate,
    caller: Caller = operator,
) -> BudgetView:
    number = _budget_number(budget_id)
    changes = {f: getattr(body, f) for f in body.model_fields_set}
    for name in ("metric", "period", "anchor", "limit", "prompt_weight", "completion_weight"):
        if name in changes and changes[name] is None:
            raise APIError(400, f"{name} cannot be null; give a value.", param=name)

    def update(session: Session) -> int:
        row = tenants.require_tenant(session, tenant)
        budget_admin.update_budget(session, caller.id, row, number, changes)
        return row.id

    tenant_id = await tenancy.store.db.run(update)
    budgets.invalidate(tenant_id)
    return (await _views(budgets, tenant_id, number)).data[0]


@operator_router.delete("/tenants/{tenant}/budgets/{budget_id}", response_model=Deleted)
async def delete_budget(
    tenancy: TenancyDep,
    budgets: BudgetsDep,
    tenant: str,
    budget_id: str,
    caller: Caller = operator,
) -> Deleted:
    number = _budget_number(budget_id)

    def delete(session: Session) -> int:
        row = tenants.require_tenant(session, tenant)
        budget_admin.delete_budget(session, caller.id, row, number)
        return row.id

    budgets.invalidate(await tenancy.store.db.run(delete))
    return Deleted(id=str(number), object="budget")


# ---- prices ------------------------------------------------------------------------------------


@operator_router.get("/prices", response_model=PriceList)
async def list_prices(tenancy: TenancyDep, caller: Caller = operator) -> PriceList:
    entries = await tenancy.store.db.run(budget_admin.list_prices)
    return PriceList(data=[PriceView(**vars(e)) for e in entries])


def _adapter(session: Session, tenant: str, ref: str) -> Any:
    row = tenants.require_tenant(session, tenant)
    adapter = TenantScope(session, row.id).adapter(ref)
    if adapter is None:
        raise APIError(
            404,
            f"Tenant {tenant!r} has no adapter {ref[:64]!r}; a price names an adapter (not a "
            "version), as listed under the tenant's adapters.",
            type=NOT_FOUND,
            code="adapter_not_found",
        )
    return row, adapter


@operator_router.put("/prices/models/{name}", response_model=PriceList)
async def set_model_price(
    tenancy: TenancyDep, budgets: BudgetsDep, name: str, body: PriceBody, caller: Caller = operator
) -> PriceList:
    """The price of the base model served as ``name`` (an adapter without its own price costs
    its base model's)."""
    _check_model_name(name)
    await tenancy.store.db.run(
        lambda s: budget_admin.set_price(
            s, caller.id, prompt=body.prompt_per_million,
            completion=body.completion_per_million, base_model=name,
        )
    )  # fmt: skip
    budgets.invalidate()
    return await list_prices(tenancy, caller)


@operator_router.delete("/prices/models/{name}", response_model=Deleted)
async def delete_model_price(
    tenancy: TenancyDep, budgets: BudgetsDep, name: str, caller: Caller = operator
) -> Deleted:
    found = await tenancy.store.db.run(
        lambda s: budget_admin.delete_price(s, caller.id, base_model=name)
    )
    if not found:
        raise _no_price(name)
    budgets.invalidate()
    return Deleted(id=name, object="price")


@operator_router.put("/tenants/{tenant}/adapters/{ref}/price", response_model=PriceList)
async def set_adapter_price(
    tenancy: TenancyDep,
    budgets: BudgetsDep,
    tenant: str,
    ref: str,
    body: PriceBody,
    caller: Caller = operator,
) -> PriceList:
    await tenancy.store.db.run(
        lambda s: budget_admin.set_price(
            s, caller.id, prompt=body.prompt_per_million,
            completion=body.completion_per_million, adapter=_adapter(s, tenant, ref),
        )
    )  # fmt: skip
    budgets.invalidate()
    return await list_prices(tenancy, caller)


@operator_router.delete("/tenants/{tenant}/adapters/{ref}/price", response_model=Deleted)
async def delete_adapter_price(
    tenancy: TenancyDep, budgets: BudgetsDep, tenant: str, ref: str, caller: Caller = operator
) -> Deleted:
    found = await tenancy.store.db.run(
        lambda s: budget_admin.delete_price(s, caller.id, adapter=_adapter(s, tenant, ref))
    )
    if not found:
        raise _no_price(f"{tenant}/{ref}")
    budgets.invalidate()
    return Deleted(id=f"{tenant}/{ref}", object="price")


def _check_model_name(name: str) -> None:
    if not 1 <= len(name) <= MAX_MODEL_NAME:
        raise APIError(
            400,
            f"A model name is 1-{MAX_MODEL_NAME} characters; got {len(name)}. Give the base "
            "model's name as /v1/models lists it.",
            param="name",
        )


def _no_price(name: str) -> APIError:
    return APIError(
        404,
        f"There is no price for {name[:140]!r}; GET /admin/api/prices lists the prices set.",
        type=NOT_FOUND,
        code="price_not_found",
    )


# ---- the tenant's own --------------------------------------------------------------------------


@tenant_router.get("/v1/budgets", response_model=BudgetList)
async def my_budgets(budgets: BudgetsDep, caller: TenantCaller) -> BudgetList:
    """The budgets that apply to the calling key: its tenant's and its own (what each used,
    its limit, and when it resets). The same figures are on every completion's
    ``x-ratelimit-*-budget-*`` headers."""
    assert caller.tenant_id is not None  # the tenant audience
    _, states = await budgets.tenant_statuses(int(caller.tenant_id), caller.key_id)
    return BudgetList(data=[BudgetView.of(s) for s in states])
