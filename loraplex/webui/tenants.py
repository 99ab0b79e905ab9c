"""The Tenants pages: the list (search, server-side pages), create, a tenant's page (quotas,
scheduling, keys, adapters, usage), edit quotas and scheduling, suspend/resume, delete (after a confirmation form).

Every change goes through ``TenantService`` (whose functions write the audit event in the same
transaction) with the actor ``admin (web)``; it has the quota manager re-read the tenant's
limits, tells the engine a new weight, and takes a deleted tenant's adapter files through the
registry, as for the admin API.

Routes (``-`` can never be a tenant name, so ``/admin/tenants/-/new`` never shadows a tenant)::

    GET  /admin/tenants                 ?q=<search>&page=<n>
    GET  /admin/tenants/-/new           POST /admin/tenants
    GET  /admin/tenants/{name}
    GET  /admin/tenants/{name}/edit     POST (same path)
    POST /admin/tenants/{name}/status   status=active|suspended
    GET  /admin/tenants/{name}/delete   POST (same path; confirm=<the tenant's name>)
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.responses import Response

from loraplex.platform import tenants as service
from loraplex.platform import usage
from loraplex.platform.db.models import Adapter, ApiKey, Tenant, utcnow
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.errors import APIError
from loraplex.platform.tenants import TenantService
from loraplex.webui.budgets import tenant_budget_rows
from loraplex.webui.context import (
    Admin,
    FormPost,
    NavItem,
    Refused,
    SignedIn,
    redirect,
    render,
    webui_of,
)
from loraplex.webui.keys import key_rows
from loraplex.webui.views import (
    QUOTA_LABELS,
    SCHEDULING_LABELS,
    WEB_ACTOR,
    FormErrors,
    Pager,
    fmt_bytes,
    fmt_count,
    fmt_limit,
    fmt_time,
    not_found,
    page_number,
    parse_quotas,
    parse_scheduling,
)

logger = logging.getLogger(__name__)

NAV = NavItem("Tenants", "/admin/tenants")
LIST = "/admin/tenants"
PAGE_SIZE = 50
MAX_SEARCH = 200
MAX_DISPLAY_NAME = 200  # the column's size

router = APIRouter(include_in_schema=False)


def tenant_path(name: str, suffix: str = "") -> str:
    return f"{LIST}/{name}{suffix}"


def _missing(name: str) -> Refused:
    return not_found(f"There is no tenant named {name[:64]!r}.", ("All tenants", LIST))


def _tenant_or_404(session: Session, name: str) -> Tenant:
    tenant = service.get_tenant(session, name)
    if tenant is None:
        raise _missing(name)
    return tenant


def _tenants(request: Request) -> TenantService:
    """Changes that reach beyond the rows (quotas, adapter files) go through the service."""
    return webui_of(request).tenancy.tenants


def _quotas(tenant: Tenant) -> list[tuple[str, str]]:
    return [(label, fmt_limit(getattr(tenant, f))) for f, label in QUOTA_LABELS.items()]


def _scheduling(tenant: Tenant) -> list[tuple[str, str]]:
    return [
        (SCHEDULING_LABELS["weight"], f"{tenant.weight:g}"),
        (SCHEDULING_LABELS["max_priority"], str(tenant.max_priority)),
    ]


def _form_values(tenant: Tenant | None) -> dict[str, str]:
    if tenant is None:
        blank = {"name": "", "display_name": "", **dict.fromkeys(QUOTA_LABELS, "")}
        return blank | {"weight": "1", "max_priority": "0"}
    values = {"name": tenant.name, "display_name": tenant.display_name}
    for field in QUOTA_LABELS:
        limit = getattr(tenant, field)
        values[field] = "" if limit is None else str(limit)
    values["weight"] = f"{tenant.weight:g}"
    values["max_priority"] = str(tenant.max_priority)
    return values


def _submitted(admin: Admin) -> dict[str, str]:
    names = ("name", "display_name", *QUOTA_LABELS, *SCHEDULING_LABELS)
    return {name: admin.field(name).strip() for name in names}


def _check_display_name(values: dict[str, str]) -> FormErrors:
    errors = FormErrors()
    if len(values["display_name"]) > MAX_DISPLAY_NAME:
        errors["display_name"] = (
            f"A display name is at most {MAX_DISPLAY_NAME} characters; shorten it."
        )
    return errors


# ---- the list --------------------------------------------------------------------------------


@router.get(LIST)
async def tenant_list(request: Request, admin: SignedIn) -> Response:
    search = request.query_params.get("q", "").strip()[:MAX_SEARCH]
    number = page_number(request.query_params.get("page"))

    def read(session: Session) -> tuple[list[dict[str, Any]], Pager]:
        pager = Pager(number, PAGE_SIZE, 0)
        rows, total = service.list_tenants(
            session, search=search, offset=pager.offset, limit=PAGE_SIZE
        )
        pager = Pager(number, PAGE_SIZE, total)
        if not rows and number > pager.last:  # past the end (the list shrank): the last page
            pager = pager.clamped()
            rows, total = service.list_tenants(
                session, search=search, offset=pager.offset, limit=PAGE_SIZE
            )
        return [_list_row(t) for t in rows], pager

    rows, pager = await webui_of(request).store.db.run(read)
    params = [("q", search)]
    return render(
        request,
        "tenants.html",
        admin=admin,
        title="Tenants",
        search=search,
        rows=rows,
        pager=pager,
        shown_to=pager.last_row(len(rows)),
        prev_url=pager.link(LIST, pager.number - 1, params) if pager.number > 1 else None,
        next_url=pager.link(LIST, pager.number + 1, params) if pager.number < pager.last else None,
        first_url=pager.link(LIST, 1, params) if pager.number > 2 else None,
        last_url=pager.link(LIST, pager.last, params) if pager.number < pager.last - 1 else None,
    )


def _list_row(t: Tenant) -> dict[str, Any]:
    return {
        "name": t.name,
        "display_name": t.display_name,
        "status": t.status,
        "requests_per_minute": fmt_limit(t.requests_per_minute),
        "tokens_per_minute": fmt_limit(t.tokens_per_minute),
        "max_concurrent_requests": fmt_limit(t.max_concurrent_requests),
        "max_adapters": fmt_limit(t.max_adapters),
        "created": fmt_time(t.created_at)[:10],
    }


# ---- create ----------------------------------------------------------------------------------


def _form_page(
    request: Request,
    admin: Admin,
    *,
    mode: str,
    values: dict[str, str],
    errors: FormErrors | None = None,
    status: int = 200,
    tenant_name: str = "",
) -> Response:
    title = "New tenant" if mode == "create" else f"Edit {tenant_name}"
    return render(
        request,
        "tenants_form.html",
        admin=admin,
        status=status,
        title=title,
        mode=mode,
        values=values,
        errors=errors or FormErrors(),
        quota_labels=QUOTA_LABELS,
        scheduling_labels=SCHEDULING_LABELS,
        weight_range=(service.MIN_WEIGHT, service.MAX_WEIGHT),
        weight_refresh_s=f"{service.WEIGHT_REFRESH_S:g}",
        tenant_name=tenant_name,
    )


@router.get(f"{LIST}/-/new")
async def new_tenant(request: Request, admin: SignedIn) -> Response:
    return _form_page(request, admin, mode="create", values=_form_values(None))


async def _check_new_name(request: Request, name: str, errors: FormErrors) -> int:
    """Notes what is wrong with a new tenant's name in ``errors`` (checked with the other
    fields, so one submit reports every field); returns the status that alone would give
    (400 malformed, 409 taken, 200 fine)."""

    def check(session: Session) -> None:
        service.check_new_tenant_name(session, name)

    try:
        await webui_of(request).store.db.run(check)
    except APIError as error:
        errors.add_api_error(error, "name")
        return error.status
    return 200


@router.post(LIST)
async def create_tenant(request: Request, admin: FormPost) -> Response:
    values = _submitted(admin)
    errors = _check_display_name(values)
    name_status = await _check_new_name(request, values["name"], errors)
    quotas = parse_quotas(values, errors)
    weight, max_priority = parse_scheduling(values, errors)
    if not errors:
        try:
            await _tenants(request).create(
                WEB_ACTOR,
                values["name"],
                display_name=values["display_name"],
                quotas=service.Quotas(**quotas),
                scheduling=service.Scheduling(
                    service.Scheduling.weight if weight is None else weight,
                    service.Scheduling.max_priority if max_priority is None else max_priority,
                ),
            )
        except APIError as error:
            errors.add_api_error(error, "name")
            return _form_page(request, admin, mode="create", values=values, errors=errors,
                              status=error.status)  # fmt: skip
        admin.flash("success", f"Tenant {values['name']} created. Give it an API key below.")
        return redirect(request, tenant_path(values["name"]))
    status = name_status if errors.keys() == {"name"} else 400  # a taken name alone: 409
    return _form_page(request, admin, mode="create", values=values, errors=errors, status=status)


# ---- a tenant's page -------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterRow:
    adapter: str
    version: str
    status: str
    rank: str
    targets: str
    size: str
    content_hash: str
    created: str


async def _adapter_rows(request: Request, tenant_id: int) -> list[AdapterRow] | None:
    """The tenant's adapter versions, through the registry (None on a server without one)."""
    registry = webui_of(request).tenancy.registry
    rows = []
    for adapter in await registry.list_adapters(tenant_id):
        for v in reversed(adapter.versions):  # newest first
            rows.append(
                AdapterRow(
                    adapter=adapter.name,
                    version=f"{adapter.name}@{v.number}",
                    status=v.status,
                    rank=str(v.rank),
                    targets=", ".join(v.target_modules),
                    size=fmt_bytes(v.size_bytes),
                    content_hash=v.content_sha256,
                    created=fmt_time(v.created_at),
                )
            )
    return rows


def _usage_summary(session: Session, tenant_id: int) -> dict[str, Any]:
    """The last 30 UTC days: totals and one row per model."""
    report = usage.tenant_usage(session, tenant_id, usage.parse_range(None, None))
    by_model: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for bucket in report.data:
        acc = by_model[bucket.model]
        for i, n in enumerate(
            (bucket.requests, bucket.errors, bucket.prompt_tokens, bucket.completion_tokens)
        ):
            acc[i] += n
    models = [
        {
            "model": model,
            "requests": fmt_count(n[0]),
            "errors": fmt_count(n[1]),
            "prompt_tokens": fmt_count(n[2]),
            "completion_tokens": fmt_count(n[3]),
        }
        for model, n in sorted(by_model.items(), key=lambda kv: -kv[1][0])
    ]
    t = report.totals
    return {
        "start": report.start.isoformat(),
        "end": report.end.isoformat(),
        "requests": fmt_count(t.requests),
        "errors": fmt_count(t.errors),
        "prompt_tokens": fmt_count(t.prompt_tokens),
        "completion_tokens": fmt_count(t.completion_tokens),
        "models": models,
    }


@router.get(LIST + "/{name}")
async def tenant_page(request: Request, name: str, admin: SignedIn) -> Response:
    now = utcnow()

    def read(session: Session) -> dict[str, Any]:
        tenant = _tenant_or_404(session, name)
        return {
            "id": tenant.id,
            "name": tenant.name,
            "display_name": tenant.display_name,
            "status": tenant.status,
            "created": fmt_time(tenant.created_at),
            "quotas": _quotas(tenant),
            "scheduling": _scheduling(tenant),
            "keys": key_rows(
                [(k, tenant.name) for k in service.list_keys(session, tenant)][::-1], now
            ),
            "usage": _usage_summary(session, tenant.id),
        }

    tenant = await webui_of(request).store.db.run(read)
    adapters = await _adapter_rows(request, tenant["id"])
    budgets = await tenant_budget_rows(request, tenant["id"])
    return render(
        request,
        "tenants_show.html",
        admin=admin,
        title=tenant["display_name"] or tenant["name"],
        tenant=tenant,
        adapters=adapters,
        budgets=budgets,
        here_path=tenant_path(tenant["name"]),
    )


# ---- edit, suspend / resume ------------------------------------------------------------------


@router.get(LIST + "/{name}/edit")
async def edit_tenant(request: Request, name: str, admin: SignedIn) -> Response:
    def read(session: Session) -> dict[str, str]:
        return _form_values(_tenant_or_404(session, name))

    values = await webui_of(request).store.db.run(read)
    return _form_page(request, admin, mode="edit", values=values, tenant_name=name)


@router.post(LIST + "/{name}/edit")
async def save_tenant(request: Request, name: str, admin: FormPost) -> Response:
    values = _submitted(admin)
    values["name"] = name
    errors = _check_display_name(values)
    quotas = parse_quotas(values, errors)
    weight, max_priority = parse_scheduling(values, errors)
    if errors:
        return _form_page(request, admin, mode="edit", values=values, errors=errors, status=400,
                          tenant_name=name)  # fmt: skip

    try:
        change = await _tenants(request).update(
            WEB_ACTOR, name, display_name=values["display_name"], quotas=quotas, weight=weight,
            max_priority=max_priority,
        )  # fmt: skip
    except APIError as error:
        if error.code == "tenant_not_found":
            raise _missing(name) from None
        errors.add_api_error(error)
        return _form_page(request, admin, mode="edit", values=values, errors=errors,
                          status=error.status, tenant_name=name)  # fmt: skip
    changed = change.changed
    admin.flash("success" if changed else "info", "Saved." if changed else "Nothing changed.")
    return redirect(request, tenant_path(name))


@router.post(LIST + "/{name}/status")
async def set_status(request: Request, name: str, admin: FormPost) -> Response:
    status = admin.field("status")
    if status not in ("active", "suspended"):
        admin.flash("error", "Choose Suspend or Resume on the tenant's page.")
        return redirect(request, tenant_path(name))

    try:
        await _tenants(request).update(WEB_ACTOR, name, status=status)
    except APIError as error:
        if error.code == "tenant_not_found":
            raise _missing(name) from None
        raise
    if status == "suspended":
        message = f"{name} is suspended: its API keys are refused from their next request."
    else:
        message = f"{name} is active again: its API keys work from their next request."
    admin.flash("success", message)
    return redirect(request, tenant_path(name))


# ---- delete ----------------------------------------------------------------------------------


def _delete_facts(session: Session, tenant: Tenant) -> dict[str, Any]:
    scope = TenantScope(session, tenant.id)
    count = select(func.count()).select_from
    return {
        "name": tenant.name,
        "display_name": tenant.display_name,
        "keys": session.scalar(count(scope.select(ApiKey).subquery())) or 0,
        "adapters": session.scalar(count(scope.select(Adapter).subquery())) or 0,
    }


def _delete_page(
    request: Request, admin: Admin, facts: dict[str, Any], error: str | None = None
) -> Response:
    return render(
        request,
        "tenants_delete.html",
        admin=admin,
        status=400 if error else 200,
        title=f"Delete {facts['name']}",
        tenant=facts,
        error=error,
    )


@router.get(LIST + "/{name}/delete")
async def confirm_delete(request: Request, name: str, admin: SignedIn) -> Response:
    def read(session: Session) -> dict[str, Any]:
        return _delete_facts(session, _tenant_or_404(session, name))

    return _delete_page(request, admin, await webui_of(request).store.db.run(read))


@router.post(LIST + "/{name}/delete")
async def delete_tenant(request: Request, name: str, admin: FormPost) -> Response:
    if admin.field("confirm").strip() != name:

        def read(session: Session) -> dict[str, Any]:
            return _delete_facts(session, _tenant_or_404(session, name))

        facts = await webui_of(request).store.db.run(read)
        error = f"Type the tenant's name, {name}, exactly to confirm; nothing was deleted."
        return _delete_page(request, admin, facts, error)
    try:
        await _tenants(request).delete(WEB_ACTOR, name)
    except APIError as error:
        if error.code == "tenant_not_found":
            raise _missing(name) from None
        raise
    admin.flash("success", f"Tenant {name} deleted, with its keys, adapters and usage.")
    return redirect(request, LIST)
