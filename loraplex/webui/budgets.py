"""The budget pages: a tenant's budgets (its own and its keys': used / limit, a bar, when each
resets; add and remove), and one key's (the tenant's budgets and the key's own, which together
decide whether the key's next request is admitted). The tenant's page shows the same table.

Figures come from ``BudgetManager.tenant_statuses`` (the admin API's, too); changes go through
``budget_admin`` with the actor ``admin (web)``, each with its audit event.

Routes::

    GET  /admin/tenants/{name}/budgets                       POST (same path: add one)
    POST /admin/tenants/{name}/budgets/{budget_id}/delete
    GET  /admin/keys/{public_id}/budgets
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session
from starlette.responses import Response

from loraplex.platform import budget_admin
from loraplex.platform import tenants as service
from loraplex.platform.budgets import ADJECTIVE, BudgetStatus, fmt_amount
from loraplex.platform.errors import APIError
from loraplex.webui.context import FormPost, SignedIn, redirect, render, webui_of
from loraplex.webui.views import WEB_ACTOR, FormErrors, fmt_time, not_found

NAV = None  # reached from the tenant's and the keys' pages
TENANTS = "/admin/tenants"

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True)
class BudgetRow:
    """One budget as the pages show it."""

    id: int
    scope: str  # "Tenant" or the key's display
    key: str | None
    what: str  # "Tokens, daily (calendar, UTC)"
    used: str
    limit: str
    percent: str
    fraction: float  # for the bar, 0..1
    soft: float | None  # the soft limit as a fraction, for the bar's "high" mark
    soft_label: str
    resets_at: str
    resets_iso: str
    state: str  # "ok" | "soft" | "exceeded"


def budget_rows(states: list[BudgetStatus]) -> list[BudgetRow]:
    rows = []
    for s in states:
        rule = s.rule
        anchor = "calendar, UTC" if rule.anchor == "calendar" else "rolling"
        what = f"{rule.metric.capitalize()}, {ADJECTIVE[rule.period]} ({anchor})"
        if rule.metric == "tokens" and (rule.prompt_weight, rule.completion_weight) != (1, 1):
            what += f"; prompt x{rule.prompt_weight:g}, completion x{rule.completion_weight:g}"
        state = "exceeded" if s.exceeded else "soft" if s.soft_crossed else "ok"
        soft = rule.soft_percent
        rows.append(
            BudgetRow(
                id=rule.id,
                scope="Tenant" if rule.key_public_id is None else f"Key {rule.key_public_id}",
                key=rule.key_public_id,
                what=what,
                used=fmt_amount(rule.metric, s.used),
                limit=fmt_amount(rule.metric, rule.limit),
                percent=f"{math.floor(100 * s.used / rule.limit):,} %",
                fraction=round(s.fraction, 4),
                soft=soft / 100 if soft is not None else None,
                soft_label=f"{soft:g} %" if soft is not None else "—",
                resets_at=fmt_time(s.resets_at) if s.resets_at else "—",
                resets_iso=s.resets_at.isoformat() if s.resets_at else "",
                state=state,
            )
        )
    return rows


async def tenant_budget_rows(request: Request, tenant_id: int) -> list[BudgetRow]:
    """Every budget of the tenant and its keys (for the tenant's page)."""
    budgets = webui_of(request).tenancy.budgets
    _, states = await budgets.tenant_statuses(tenant_id, every_key=True)
    return budget_rows(states)


def _tenant(session: Session, name: str) -> tuple[int, str, list[tuple[str, str]]]:
    tenant = service.get_tenant(session, name)
    if tenant is None:
        raise not_found(f"There is no tenant named {name[:64]!r}.", ("All tenants", TENANTS))
    keys = [(k.public_id, k.name or k.public_id) for k in service.list_keys(session, tenant)
            if k.revoked_at is None]  # fmt: skip
    return tenant.id, tenant.name, keys


BLANK = {
    "scope": "",
    "metric": "tokens",
    "period": "day",
    "anchor": "calendar",
    "limit": "",
    "soft_percent": "",
    "prompt_weight": "1",
    "completion_weight": "1",
}


async def _page(
    request: Request,
    admin: Any,
    name: str,
    *,
    values: dict[str, str] | None = None,
    errors: FormErrors | None = None,
    status: int = 200,
) -> Response:
    tenant_id, tenant_name, keys = await webui_of(request).store.db.run(lambda s: _tenant(s, name))
    return render(
        request,
        "budgets.html",
        admin=admin,
        status=status,
        title=f"Budgets of {tenant_name}",
        tenant_name=tenant_name,
        budgets=await tenant_budget_rows(request, tenant_id),
        scopes=[("", "The whole tenant")] + [(p, f"Key {label}") for p, label in keys],
        values=values or BLANK,
        errors=errors or FormErrors(),
    )


@router.get(TENANTS + "/{name}/budgets")
async def budgets_page(request: Request, name: str, admin: SignedIn) -> Response:
    return await _page(request, admin, name)


def _number(values: dict[str, str], name: str, errors: FormErrors, *, blank: bool) -> Any:
    text = values[name]
    if not text:
        if not blank:
            errors[name] = "Give a number."
        return None
    try:
        return float(text)
    except ValueError:
        errors[name] = f"{text[:40]!r} is not a number."
        return None


@router.post(TENANTS + "/{name}/budgets")
async def add_budget(request: Request, name: str, admin: FormPost) -> Response:
    values = {field: admin.field(field).strip() for field in BLANK}
    errors = FormErrors()
    numbers = {
        "limit": _number(values, "limit", errors, blank=False),
        "soft_percent": _number(values, "soft_percent", errors, blank=True),
        "prompt_weight": _number(values, "prompt_weight", errors, blank=False),
        "completion_weight": _number(values, "completion_weight", errors, blank=False),
    }
    if not errors:
        budgets = webui_of(request).tenancy.budgets

        def create(session: Session) -> int:
            tenant = service.get_tenant(session, name)
            if tenant is None:
                raise not_found(f"There is no tenant named {name[:64]!r}.", ("All", TENANTS))
            budget_admin.create_budget(
                session, WEB_ACTOR, tenant, key_public_id=values["scope"] or None,
                metric=values["metric"], period=values["period"], anchor=values["anchor"],
                **numbers,
            )  # fmt: skip
            return tenant.id

        try:
            budgets.invalidate(await webui_of(request).store.db.run(create))
        except APIError as error:
            errors.add_api_error(error, "_")
            if error.param == "key":
                errors["scope"] = errors.pop("key")
    if errors:
        return await _page(request, admin, name, values=values, errors=errors, status=400)
    admin.flash("success", "Budget added: it applies from the next request.")
    return redirect(request, f"{TENANTS}/{name}/budgets")


@router.post(TENANTS + "/{name}/budgets/{budget_id}/delete")
async def remove_budget(request: Request, name: str, budget_id: int, admin: FormPost) -> Response:
    def delete(session: Session) -> int:
        tenant = service.get_tenant(session, name)
        if tenant is None:
            raise not_found(f"There is no tenant named {name[:64]!r}.", ("All", TENANTS))
        budget_admin.delete_budget(session, WEB_ACTOR, tenant, budget_id)
        return tenant.id

    try:
        webui_of(request).tenancy.budgets.invalidate(await webui_of(request).store.db.run(delete))
    except APIError as error:
        admin.flash("error", error.message)
    else:
        admin.flash("success", "Budget removed.")
    return redirect(request, f"{TENANTS}/{name}/budgets")


@router.get("/admin/keys/{public_id}/budgets")
async def key_budgets(request: Request, public_id: str, admin: SignedIn) -> Response:
    def read(session: Session) -> tuple[int, str, str]:
        found = budget_admin.key_owner(session, public_id)
        if found is None:
            raise not_found(f"There is no API key {public_id[:40]!r}.", ("All keys", "/admin/keys"))
        return found

    tenant_id, tenant_name, key_name = await webui_of(request).store.db.run(read)
    budgets = webui_of(request).tenancy.budgets
    _, states = await budgets.tenant_statuses(tenant_id, public_id)
    return render(
        request,
        "budgets_key.html",
        admin=admin,
        title=f"Budgets of key {public_id}",
        tenant_name=tenant_name,
        public_id=public_id,
        key_name=key_name,
        budgets=budget_rows(states),
    )
