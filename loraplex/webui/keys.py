"""The Keys pages: every tenant's API keys, create a key (its secret shown exactly once, its
models optionally limited), change a key's name and models, revoke a key (after a confirmation
form).

The secret is shown once without ever being resent: the POST that creates a key keeps the token
in ``OneTimeSecrets`` (memory, bound to the operator's session) and redirects to the key's
"created" page, whose first view takes it out. Reloading that page, or opening it from another
session, finds nothing and says so; the database holds only the secret's SHA-256.

Routes::

    GET  /admin/keys                     ?tenant=<name>&status=<active|revoked|expired>&before=<id>
    GET  /admin/keys/new                 ?tenant=<name>       POST /admin/keys
    GET  /admin/keys/{public_id}/created
    GET  /admin/keys/{public_id}/edit    POST (same path)
    GET  /admin/keys/{public_id}/revoke  POST (same path)
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from functools import partial
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from sqlalchemy import Select, or_, select
from sqlalchemy.orm import Session
from starlette.responses import Response

from loraplex.platform import tenants as service
from loraplex.platform.auth import SCOPE_ADAPTERS_WRITE, SCOPE_INFERENCE
from loraplex.platform.db.models import ApiKey, Tenant, utcnow
from loraplex.platform.db.scope import TenantScope, find_key
from loraplex.platform.errors import APIError
from loraplex.platform.keys import display_key
from loraplex.platform.model_access import check_allowed_models, describe
from loraplex.webui.context import (
    Admin,
    FormPost,
    NavItem,
    Refused,
    SignedIn,
    redirect,
    render,
    safe_next,
    webui_of,
)
from loraplex.webui.sessions import OneTimeSecrets
from loraplex.webui.tenant_picker import tenant_picker
from loraplex.webui.views import (
    WEB_ACTOR,
    FormErrors,
    fmt_ago,
    fmt_iso,
    fmt_time,
    not_found,
    whole_number,
)

NAV = NavItem("Keys", "/admin/keys")
LIST = "/admin/keys"
PAGE_SIZE = 50
MAX_EXPIRY_DAYS = 3650
MAX_BEFORE_ID = 10**11 - 1  # ?before= (a key id)
SCOPES: tuple[tuple[str, str], ...] = (
    (SCOPE_INFERENCE, "inference — completions, chat, models"),
    (SCOPE_ADAPTERS_WRITE, "adapters:write — upload and delete adapters"),
)
STATUSES = ("active", "expired", "revoked")
MODELS_HINT = (
    "Optional: the only models the key may use, separated by commas: the base model's name, "
    "adapter names (every version) or name@N (one version). Others answer 404, as if missing. "
    "Leave blank for every model."
)

router = APIRouter(include_in_schema=False)


# ---- the secret, between the POST and the page that shows it ---------------------------------


def new_secrets(request: Request) -> OneTimeSecrets:
    return webui_of(request).new_keys


# ---- rows --------------------------------------------------------------------------------------


def key_status(key: ApiKey, now: dt.datetime) -> str:
    if key.revoked_at is not None:
        return "revoked"
    if key.expires_at is not None and now >= key.expires_at:
        return "expired"
    return "active"


def key_rows(keys: Sequence[tuple[ApiKey, str]], now: dt.datetime) -> list[dict[str, Any]]:
    """``(key, tenant name)`` pairs as the keys tables show them."""
    return [
        {
            "public_id": key.public_id,
            "tenant": tenant,
            "name": key.name,
            "display": display_key(key.public_id, key.last4),
            "scopes": ", ".join(key.scopes),
            "models": describe(key.allowed_models),
            "created": fmt_time(key.created_at)[:10],
            "created_full": fmt_time(key.created_at),
            "last_used": fmt_ago(key.last_used_at, now),
            "last_used_iso": fmt_iso(key.last_used_at),
            "expires": fmt_time(key.expires_at)[:10] if key.expires_at else "never",
            "expires_full": fmt_time(key.expires_at) if key.expires_at else "never",
            "status": key_status(key, now),
        }
        for key, tenant in keys
    ]


def _key_query(
    session: Session, tenant: Tenant | None, status: str, now: dt.datetime
) -> Select[Any]:
    """Keys (with their tenant's name), newest first; one tenant's through its ``TenantScope``."""
    if tenant is not None:
        query: Select[Any] = TenantScope(session, tenant.id).select(ApiKey)
    else:  # the operator's view across tenants
        query = select(ApiKey)
    query = query.join(Tenant, ApiKey.tenant_id == Tenant.id).add_columns(Tenant.name)
    if status == "revoked":
        query = query.where(ApiKey.revoked_at.is_not(None))
    elif status == "expired":
        query = query.where(ApiKey.revoked_at.is_(None), ApiKey.expires_at <= now)
    elif status == "active":
        query = query.where(
            ApiKey.revoked_at.is_(None),
            or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
        )
    return query.order_by(ApiKey.id.desc())


# ---- the list ----------------------------------------------------------------------------------


@router.get(LIST)
async def key_list(request: Request, admin: SignedIn) -> Response:
    params = request.query_params
    tenant_name = params.get("tenant", "").strip()[:64]
    status = params.get("status", "")
    status = status if status in STATUSES else ""
    before_text = params.get("before", "")
    before_id = whole_number(before_text, len(str(MAX_BEFORE_ID))) if before_text else None
    if before_text and (before_id is None or not 1 <= before_id <= MAX_BEFORE_ID):
        raise Refused(
            400,
            "Broken page link",
            f"The link to older keys is broken: before= takes a key id from 1 to "
            f"{MAX_BEFORE_ID:,}, and the address has {before_text[:20]!r}. Open the newest "
            "keys instead.",
            action=("Newest keys", LIST),
        )
    now = utcnow()

    def read(session: Session) -> tuple[list[dict[str, Any]], int | None, str | None]:
        tenant = None
        if tenant_name:
            tenant = service.get_tenant(session, tenant_name)
            if tenant is None:
                return [], None, f"There is no tenant named {tenant_name!r}."
        query = _key_query(session, tenant, status, now)
        if before_id is not None:
            query = query.where(ApiKey.id < before_id)
        found = [(key, name) for key, name in session.execute(query.limit(PAGE_SIZE + 1))]
        more = len(found) > PAGE_SIZE
        found = found[:PAGE_SIZE]
        older = found[-1][0].id if more else None
        return key_rows(found, now), older, None

    rows, older, error = await webui_of(request).store.db.run(read)
    filters = {"tenant": tenant_name, "status": status}
    return render(
        request,
        "keys.html",
        admin=admin,
        title="API keys",
        rows=rows,
        filters=filters,
        statuses=STATUSES,
        error=error,
        paged=before_id is not None,
        older_query=_query({**filters, "before": str(older)}) if older is not None else None,
        newest_query=_query(filters),
    )


def _query(values: dict[str, str]) -> str:
    return urlencode([(k, v) for k, v in values.items() if v])


# ---- create ------------------------------------------------------------------------------------


async def _form_page(
    request: Request,
    admin: Admin,
    values: dict[str, Any],
    errors: FormErrors | None = None,
    status: int = 200,
) -> Response:
    may_act = not admin.session.read_only
    tenants = await webui_of(request).store.db.run(partial(tenant_picker, may_act=may_act))
    return render(
        request,
        "keys_form.html",
        admin=admin,
        status=status,
        title="New API key",
        values=values,
        errors=errors or FormErrors(),
        scopes=SCOPES,
        max_days=MAX_EXPIRY_DAYS,
        models_hint=MODELS_HINT,
        tenants=tenants,
    )


@router.get(LIST + "/new")
async def new_key(request: Request, admin: SignedIn) -> Response:
    tenant = request.query_params.get("tenant", "").strip()[:64]
    values = {
        "tenant": tenant,
        "name": "",
        "scopes": [s for s, _ in SCOPES],
        "expires_days": "",
        "allowed_models": "",
    }
    return await _form_page(request, admin, values)


def _models(text: str, errors: FormErrors) -> list[str] | None:
    """The form's model list (commas or new lines); blank: every model."""
    names = [n for n in re.split(r"[,\n]", text) if n.strip()]
    if not names:
        return None
    try:
        return check_allowed_models(names, param="allowed_models")
    except APIError as error:
        errors.add_api_error(error)
        return None


def _expiry(text: str, errors: FormErrors, now: dt.datetime) -> dt.datetime | None:
    text = text.strip()
    if not text:
        return None
    days = whole_number(text)
    if days is None or not 1 <= days <= MAX_EXPIRY_DAYS:
        errors["expires_days"] = (
            f"Enter a whole number of days from 1 to {MAX_EXPIRY_DAYS:,}, or leave it blank "
            "for a key that does not expire."
        )
        return None
    return now + dt.timedelta(days=days)


@router.post(LIST)
async def create_key(request: Request, admin: FormPost) -> Response:
    assert admin.form is not None
    now = utcnow()
    scopes = [s for s in admin.form.getlist("scopes") if isinstance(s, str)]
    values: dict[str, Any] = {
        "tenant": admin.field("tenant").strip(),
        "name": admin.field("name").strip(),
        "scopes": scopes,
        "expires_days": admin.field("expires_days").strip(),
        "allowed_models": admin.field("allowed_models").strip(),
    }
    errors = FormErrors()
    if not values["tenant"]:
        errors["tenant"] = "Enter the name of the tenant the key is for (see the Tenants page)."
    if len(values["name"]) > 100:
        errors["name"] = "A key's name is at most 100 characters."
    if not scopes:
        errors["scopes"] = "Tick at least one scope: a key without scopes can do nothing."
    expires_at = _expiry(values["expires_days"], errors, now)
    models = _models(values["allowed_models"], errors)
    if errors:
        return await _form_page(request, admin, values, errors, status=400)

    def create(session: Session) -> tuple[str, str]:
        tenant = service.get_tenant(session, values["tenant"])
        if tenant is None:
            raise APIError(
                404,
                f"There is no tenant named {values['tenant'][:64]!r}; check the name on the "
                "Tenants page.",
                param="tenant",
            )
        key, new = service.create_key(
            session, WEB_ACTOR, tenant, name=values["name"], scopes=scopes, expires_at=expires_at,
            allowed_models=models,
        )  # fmt: skip
        return key.public_id, new.token

    try:
        public_id, token = await webui_of(request).store.db.run(create)
    except APIError as error:
        errors.add_api_error(error)
        return await _form_page(request, admin, values, errors, status=error.status)
    new_secrets(request).put(admin.session, public_id, token)
    return redirect(request, f"{LIST}/{public_id}/created")


def _key_or_404(session: Session, public_id: str) -> tuple[ApiKey, Tenant]:
    found = find_key(session, public_id)
    if found is None:
        raise not_found(f"There is no API key {public_id[:40]!r}.", ("All keys", LIST))
    return found


@router.get(LIST + "/{public_id}/created")
async def key_created(request: Request, public_id: str, admin: SignedIn) -> Response:
    now = utcnow()

    def read(session: Session) -> dict[str, Any]:
        key, tenant = _key_or_404(session, public_id)
        return key_rows([(key, tenant.name)], now)[0]

    key = await webui_of(request).store.db.run(read)
    token = new_secrets(request).take(admin.session, public_id)
    return render(
        request, "keys_created.html", admin=admin, title="API key created", key=key, token=token
    )


# ---- edit: name and models ---------------------------------------------------------------------


def _edit_page(
    request: Request,
    admin: Admin,
    key: dict[str, Any],
    values: dict[str, str],
    errors: FormErrors | None = None,
    status: int = 200,
) -> Response:
    return render(
        request,
        "keys_edit.html",
        admin=admin,
        status=status,
        title="Edit API key",
        key=key,
        values=values,
        errors=errors or FormErrors(),
        models_hint=MODELS_HINT,
    )


@router.get(LIST + "/{public_id}/edit")
async def edit_key(request: Request, public_id: str, admin: SignedIn) -> Response:
    now = utcnow()

    def read(session: Session) -> tuple[dict[str, Any], dict[str, str]]:
        key, tenant = _key_or_404(session, public_id)
        models = ", ".join(key.allowed_models) if key.allowed_models is not None else ""
        return key_rows([(key, tenant.name)], now)[0], {"name": key.name, "allowed_models": models}

    key, values = await webui_of(request).store.db.run(read)
    return _edit_page(request, admin, key, values)


@router.post(LIST + "/{public_id}/edit")
async def save_key(request: Request, public_id: str, admin: FormPost) -> Response:
    now = utcnow()
    values = {
        "name": admin.field("name").strip(),
        "allowed_models": admin.field("allowed_models").strip(),
    }
    errors = FormErrors()
    if len(values["name"]) > 100:
        errors["name"] = "A key's name is at most 100 characters."
    models = _models(values["allowed_models"], errors)

    def save(session: Session) -> tuple[dict[str, Any], str]:
        key, tenant = _key_or_404(session, public_id)
        if not errors:
            service.update_key(
                session, WEB_ACTOR, tenant, public_id, name=values["name"], allowed_models=models
            )
        return key_rows([(key, tenant.name)], now)[0], tenant.name

    key, tenant = await webui_of(request).store.db.run(save)
    if errors:
        return _edit_page(request, admin, key, values, errors, status=400)
    admin.flash("success", f"Key {key['display']} saved: models {key['models']}, from its next "
                "request.")  # fmt: skip
    return redirect(request, f"/admin/tenants/{tenant}")


# ---- revoke ------------------------------------------------------------------------------------


def _revoke_page(request: Request, admin: Admin, key: dict[str, Any], back: str) -> Response:
    return render(
        request, "keys_revoke.html", admin=admin, title="Revoke API key", key=key, back=back
    )


def _back(value: str | None, tenant: str) -> str:
    """Where to go after revoking: the page the operator came from, else the tenant's page."""
    back = safe_next(value)
    return back if value and back == value else f"/admin/tenants/{tenant}"


@router.get(LIST + "/{public_id}/revoke")
async def confirm_revoke(request: Request, public_id: str, admin: SignedIn) -> Response:
    now = utcnow()

    def read(session: Session) -> dict[str, Any]:
        key, tenant = _key_or_404(session, public_id)
        return key_rows([(key, tenant.name)], now)[0]

    key = await webui_of(request).store.db.run(read)
    return _revoke_page(request, admin, key, _back(request.query_params.get("back"), key["tenant"]))


@router.post(LIST + "/{public_id}/revoke")
async def revoke_key(request: Request, public_id: str, admin: FormPost) -> Response:
    def revoke(session: Session) -> tuple[str, str, bool]:
        key, tenant = _key_or_404(session, public_id)
        was_revoked = key.revoked_at is not None
        service.revoke_key(session, WEB_ACTOR, tenant, public_id)
        return tenant.name, display_key(key.public_id, key.last4), was_revoked

    tenant, shown, was_revoked = await webui_of(request).store.db.run(revoke)
    if was_revoked:
        admin.flash("info", f"Key {shown} was already revoked.")
    else:
        admin.flash("success", f"Key {shown} revoked: it is refused from its next request.")
    return redirect(request, _back(admin.field("back") or None, tenant))
