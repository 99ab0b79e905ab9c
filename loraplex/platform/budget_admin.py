"""The operator's changes to budgets and prices (admin API, admin UI): checked (400 naming the
field), each with its audit event in the same transaction; and the lookups their views need.
Admission reads what these write through ``budget_store``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform import audit
from loraplex.platform.budgets import ANCHORS, METRICS, PERIODS
from loraplex.platform.db.models import Adapter, ApiKey, Budget, ModelPrice, Tenant
from loraplex.platform.db.scope import TenantScope, find_key
from loraplex.platform.errors import NOT_FOUND, APIError, clip

MAX_LIMIT = 1e15  # tokens or dollars: far past any real budget, inside every float column
MAX_WEIGHT = 1e6
MAX_PRICE = 1e9  # dollars per million tokens


# ---- budgets -----------------------------------------------------------------------------------


def budget_not_found(budget_id: int) -> APIError:
    return APIError(
        404,
        f"This tenant has no budget {budget_id}; list its budgets to find the id.",
        type=NOT_FOUND,
        code="budget_not_found",
    )


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_budget")


def _finite(value: float, low: float, high: float, param: str, what: str) -> float:
    # An int past a float's range (JSON allows 400 digits) is compared, never converted.
    if not (low <= value <= high and math.isfinite(value)):
        raise _bad(f"{param} must be {what} from {low:g} to {high:g}; got {clip(value)}.", param)
    return float(value)


def check_budget(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` of a budget checked (400 naming the first wrong one); returns them."""
    for name, allowed in (("metric", METRICS), ("period", PERIODS), ("anchor", ANCHORS)):
        if name in fields and fields[name] not in allowed:
            raise _bad(
                f"{name} must be one of {', '.join(allowed)}; got {clip(fields[name])}.", name
            )
    if "limit" in fields:
        if not fields["limit"] > 0:
            raise _bad(f"limit must be above 0; got {clip(fields['limit'])}.", "limit")
        _finite(fields["limit"], 0, MAX_LIMIT, "limit", "a number")
    if fields.get("soft_percent") is not None:
        _finite(fields["soft_percent"], 1, 100, "soft_percent", "a percentage")
    for name in ("prompt_weight", "completion_weight"):
        if name in fields:
            _finite(fields[name], 0, MAX_WEIGHT, name, "a weight")
    return fields


def budget_snapshot(budget: Budget, key_public_id: str | None) -> dict[str, Any]:
    return {
        "key": key_public_id,
        "metric": budget.metric,
        "period": budget.period,
        "anchor": budget.anchor,
        "limit": budget.limit_amount,
        "soft_percent": budget.soft_percent,
        "prompt_weight": budget.prompt_weight,
        "completion_weight": budget.completion_weight,
    }


def create_budget(
    session: Session,
    actor: str,
    tenant: Tenant,
    *,
    key_public_id: str | None,
    metric: str,
    period: str,
    anchor: str = "calendar",
    limit: float,
    soft_percent: float | None = None,
    prompt_weight: float = 1.0,
    completion_weight: float = 1.0,
) -> tuple[Budget, str | None]:
    """A new budget of ``tenant`` (or of its key ``key_public_id``)."""
    check_budget(
        {"metric": metric, "period": period, "anchor": anchor, "limit": limit,
         "soft_percent": soft_percent, "prompt_weight": prompt_weight,
         "completion_weight": completion_weight}
    )  # fmt: skip
    scope = TenantScope(session, tenant.id)
    key_id = None
    if key_public_id is not None:
        key = scope.key(key_public_id)
        if key is None:
            raise APIError(
                404,
                f"Tenant {tenant.name!r} has no API key {key_public_id[:40]!r}; a key budget "
                "names one of the tenant's keys by its public id.",
                type=NOT_FOUND,
                param="key",
                code="key_not_found",
            )
        key_id = key.id
    budget = scope.add(
        Budget(
            api_key_id=key_id,
            metric=metric,
            period=period,
            anchor=anchor,
            limit_amount=float(limit),
            soft_percent=soft_percent,
            prompt_weight=float(prompt_weight),
            completion_weight=float(completion_weight),
        )
    )
    session.flush()
    audit.record(
        session, actor, "budget.create", "budget", str(budget.id), tenant_name=tenant.name,
        after=budget_snapshot(budget, key_public_id),
    )  # fmt: skip
    return budget, key_public_id


def _budget(session: Session, tenant: Tenant, budget_id: int) -> tuple[Budget, str | None]:
    row = session.execute(
        TenantScope(session, tenant.id)
        .select(Budget)
        .add_columns(ApiKey.public_id)
        .outerjoin(ApiKey, Budget.api_key_id == ApiKey.id)
        .where(Budget.id == budget_id)
    ).first()
    if row is None:
        raise budget_not_found(budget_id)
    return row[0], row[1]


def update_budget(
    session: Session, actor: str, tenant: Tenant, budget_id: int, changes: dict[str, Any]
) -> tuple[Budget, str | None]:
    """Change the fields in ``changes`` (metric, period, anchor, limit, soft_percent, weights)."""
    check_budget(changes)
    budget, public_id = _budget(session, tenant, budget_id)
    before = budget_snapshot(budget, public_id)
    columns = {"limit": "limit_amount"}
    for name, value in changes.items():
        setattr(budget, columns.get(name, name), value)
    session.flush()
    audit.record(
        session, actor, "budget.update", "budget", str(budget.id), tenant_name=tenant.name,
        before=before, after=budget_snapshot(budget, public_id),
    )  # fmt: skip
    return budget, public_id


def delete_budget(session: Session, actor: str, tenant: Tenant, budget_id: int) -> None:
    budget, public_id = _budget(session, tenant, budget_id)
    before = budget_snapshot(budget, public_id)
    session.delete(budget)
    audit.record(
        session, actor, "budget.delete", "budget", str(budget_id), tenant_name=tenant.name,
        before=before,
    )  # fmt: skip


# ---- prices ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PriceEntry:
    """One row of the price table, for views: ``model`` is the base model's name or
    ``tenant/adapter``."""

    kind: str  # "base" | "adapter"
    model: str
    tenant: str | None
    adapter: str | None
    prompt_per_million: float
    completion_per_million: float


def list_prices(session: Session) -> list[PriceEntry]:
    rows = session.execute(
        select(ModelPrice, Adapter.name, Tenant.name)
        .outerjoin(Adapter, ModelPrice.adapter_id == Adapter.id)
        .outerjoin(Tenant, Adapter.tenant_id == Tenant.id)
        .order_by(ModelPrice.adapter_id.is_not(None), ModelPrice.base_model, Tenant.name)
    ).tuples()
    out = []
    for price, adapter, tenant in rows:
        base = price.base_model is not None
        out.append(
            PriceEntry(
                kind="base" if base else "adapter",
                model=price.base_model if base and price.base_model else f"{tenant}/{adapter}",
                tenant=None if base else tenant,
                adapter=None if base else adapter,
                prompt_per_million=price.prompt_per_million,
                completion_per_million=price.completion_per_million,
            )
        )
    return out


def _check_price(prompt: float, completion: float) -> None:
    _finite(prompt, 0, MAX_PRICE, "prompt_per_million", "a price in dollars")
    _finite(completion, 0, MAX_PRICE, "completion_per_million", "a price in dollars")


def set_price(
    session: Session,
    actor: str,
    *,
    prompt: float,
    completion: float,
    base_model: str | None = None,
    adapter: tuple[Tenant, Adapter] | None = None,
) -> None:
    """Set the price of ``base_model`` or of ``adapter`` (its tenant and row)."""
    _check_price(prompt, completion)
    if adapter is not None:
        row = session.scalar(select(ModelPrice).where(ModelPrice.adapter_id == adapter[1].id))
        object_id, tenant_name = f"{adapter[0].name}/{adapter[1].name}", adapter[0].name
    else:
        row = session.scalar(select(ModelPrice).where(ModelPrice.base_model == base_model))
        object_id, tenant_name = str(base_model), None
    before = _price_facts(row) if row is not None else None
    if row is None:
        row = ModelPrice(
            base_model=base_model,
            adapter_id=adapter[1].id if adapter is not None else None,
            prompt_per_million=prompt,
            completion_per_million=completion,
        )
        session.add(row)
    row.prompt_per_million, row.completion_per_million = float(prompt), float(completion)
    session.flush()
    audit.record(
        session, actor, "price.set", "price", object_id, tenant_name=tenant_name,
        before=before, after=_price_facts(row),
    )  # fmt: skip


def delete_price(
    session: Session,
    actor: str,
    *,
    base_model: str | None = None,
    adapter: tuple[Tenant, Adapter] | None = None,
) -> bool:
    """Remove a price; False when there was none."""
    if adapter is not None:
        row = session.scalar(select(ModelPrice).where(ModelPrice.adapter_id == adapter[1].id))
        object_id, tenant_name = f"{adapter[0].name}/{adapter[1].name}", adapter[0].name
    else:
        row = session.scalar(select(ModelPrice).where(ModelPrice.base_model == base_model))
        object_id, tenant_name = str(base_model), None
    if row is None:
        return False
    before = _price_facts(row)
    session.delete(row)
    audit.record(
        session, actor, "price.delete", "price", object_id, tenant_name=tenant_name,
        before=before,
    )  # fmt: skip
    return True


def _price_facts(row: ModelPrice) -> dict[str, Any]:
    return {
        "prompt_per_million": row.prompt_per_million,
        "completion_per_million": row.completion_per_million,
    }


def key_owner(session: Session, public_id: str) -> tuple[int, str, str] | None:
    """The tenant id, tenant name and key name of the key ``public_id`` (None: no such key)."""
    found = find_key(session, public_id)
    return (found[1].id, found[1].name, found[0].name) if found is not None else None
