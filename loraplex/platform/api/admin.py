"""The operator's JSON API under ``/admin/api``: tenants (with quotas), their keys, usage, the
audit log and the engine's state.

Every route needs the ``admin`` scope, which only the operator's admin token gives (tenant keys
never carry it: 403; no or a bad token: 401). The tenant and key logic is
``loraplex.platform.tenants`` (shared with the ``loraplex admin`` CLI); every change writes its
audit event in the same transaction, with the operator as the actor. Every request body refuses
unknown fields (400 naming them, ``api.bodies.StrictBody``): a misspelt or misplaced setting
must not look applied.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from functools import partial
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import AwareDatetime, BaseModel, Field, StrictFloat, StrictInt
from sqlalchemy.orm import Session

from loraplex.platform import audit, tenants, usage
from loraplex.platform.access import operator_caller
from loraplex.platform.api.bodies import StrictBody
from loraplex.platform.auth import Caller
from loraplex.platform.db.models import ApiKey, Tenant, utcnow
from loraplex.platform.deps import ClientDep, StoreDep, TenantsDep, UsageDep
from loraplex.platform.engine_state import EngineNotAnswering, read_engine_stats
from loraplex.platform.errors import APIError, clip, engine_unavailable
from loraplex.platform.keys import display_key

logger = logging.getLogger(__name__)

MAX_PAGE = 500
MAX_OFFSET = 10**9  # far past any tenant list, and inside every database's integer
# Keys expire before this: far enough for "never", near enough that no conversion overflows.
MAX_EXPIRES_AT = dt.datetime(9999, 1, 1, tzinfo=dt.timezone.utc)

router = APIRouter(prefix="/admin/api", tags=["admin"])
operator = Depends(operator_caller)  # the router's audience is "operator" (app.mount_routes)


# ---- bodies and views --------------------------------------------------------------------------


# Short names operators type for the quotas, and where each belongs.
_QUOTA_ALIASES = {
    "rpm": "requests_per_minute",
    "tpm": "tokens_per_minute",
    "max_concurrent": "max_concurrent_requests",
    "concurrency": "max_concurrent_requests",
}


class QuotasBody(StrictBody):
    """Limits; null = unlimited. In a PATCH only the limits given change."""

    unknown_hints: ClassVar[dict[str, str]] = {
        short: f"For {short!r} write {full!r}." for short, full in _QUOTA_ALIASES.items()
    }

    requests_per_minute: StrictInt | None = None
    tokens_per_minute: StrictInt | None = None
    max_concurrent_requests: StrictInt | None = None
    max_adapters: StrictInt | None = None


_WEIGHT = (
    f"share of the engine when backlogged under the fair policy (1 = an equal share), from "
    f"{tenants.MIN_WEIGHT:g} to {tenants.MAX_WEIGHT:g}"
)
_MAX_PRIORITY = "the most urgent request priority the tenant may send (lower runs earlier)"


def _quota_hint(field: str, full: str) -> str:
    return f'Limits go inside "quotas": {{"quotas": {{"{full}": 2}}}} (for {field!r}).'


# A quota given beside "quotas" instead of inside it, by its name or a short one.
_TENANT_HINTS = {f: _quota_hint(f, f) for f in tenants.QUOTA_FIELDS} | {
    short: _quota_hint(short, full) for short, full in _QUOTA_ALIASES.items()
}


class TenantCreate(StrictBody):
    unknown_hints: ClassVar[dict[str, str]] = _TENANT_HINTS

    name: str = Field(description="a slug: lowercase letters, digits, '-' and '_'")
    display_name: str = Field("", max_length=200)
    quotas: QuotasBody | None = None
    weight: StrictFloat | StrictInt = Field(1.0, description=_WEIGHT)
    max_priority: StrictInt = Field(0, description=_MAX_PRIORITY)


class TenantUpdate(StrictBody):
    unknown_hints: ClassVar[dict[str, str]] = _TENANT_HINTS

    display_name: str | None = Field(None, max_length=200)
    status: Literal["active", "suspended"] | None = None
    quotas: QuotasBody | None = None
    weight: StrictFloat | StrictInt | None = Field(None, description=_WEIGHT)
    max_priority: StrictInt | None = Field(None, description=_MAX_PRIORITY)


_ALLOWED_MODELS = (
    "the only models the key may use: the base model's name, adapter names (every version) "
    "and 'name@N' (one version); others answer 404 model_not_found. null: every model"
)


class KeyCreate(StrictBody):
    name: str = Field("", max_length=100)
    scopes: list[str] | None = Field(None, description="default: inference, adapters:write")
    expires_at: AwareDatetime | None = None
    allowed_models: list[str] | None = Field(None, description=_ALLOWED_MODELS)


class KeyUpdate(StrictBody):
    """Only the fields given change; ``allowed_models: null`` lifts the limit."""

    name: str | None = Field(None, max_length=100)
    allowed_models: list[str] | None = Field(None, description=_ALLOWED_MODELS)


class TenantView(BaseModel):
    object: Literal["tenant"] = "tenant"
    name: str
    display_name: str
    status: str
    quotas: QuotasBody
    weight: float
    max_priority: int
    created_at: dt.datetime
    updated_at: dt.datetime

    @classmethod
    def of(cls, tenant: Tenant) -> TenantView:
        return cls(
            name=tenant.name,
            display_name=tenant.display_name,
            status=tenant.status,
            quotas=QuotasBody(**{f: getattr(tenant, f) for f in tenants.QUOTA_FIELDS}),
            weight=tenant.weight,
            max_priority=tenant.max_priority,
            created_at=tenant.created_at,
            updated_at=tenant.updated_at,
        )


class TenantList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantView]
    total: int  # tenants matching ``search``
    offset: int
    limit: int


class KeyView(BaseModel):
    object: Literal["api_key"] = "api_key"
    id: str  # the public id
    name: str
    display: str  # lpx_<public id>…<last 4>
    scopes: list[str]
    allowed_models: list[str] | None  # None: every model of the tenant
    status: Literal["active", "expired", "revoked"]
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None

    @classmethod
    def of(cls, key: ApiKey, now: dt.datetime) -> KeyView:
        status: Literal["active", "expired", "revoked"] = "active"
        if key.revoked_at is not None:
            status = "revoked"
        elif key.expires_at is not None and now >= key.expires_at:
            status = "expired"
        return cls(
            id=key.public_id,
            name=key.name,
            display=display_key(key.public_id, key.last4),
            scopes=list(key.scopes),
            allowed_models=None if key.allowed_models is None else list(key.allowed_models),
            status=status,
            created_at=key.created_at,
            last_used_at=key.last_used_at,
            expires_at=key.expires_at,
            revoked_at=key.revoked_at,
        )


class NewKeyView(KeyView):
    key: str = Field(description="the whole key; shown this once, never again")


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyView]


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool = True


# ---- helpers -----------------------------------------------------------------------------------


def _check_page(offset: int, limit: int) -> None:
    if not 0 <= offset <= MAX_OFFSET:
        raise APIError(
            400, f"offset must be from 0 to {MAX_OFFSET}; got {clip(offset, 40)}.", param="offset"
        )
    if not 1 <= limit <= MAX_PAGE:
        raise APIError(
            400, f"limit must be from 1 to {MAX_PAGE}; got {clip(limit, 40)}.", param="limit"
        )


# ---- tenants -----------------------------------------------------------------------------------


@router.get("/tenants", response_model=TenantList)
async def list_tenants(
    store: StoreDep,
    search: str = Query("", max_length=200, description="part of the name or display name"),
    offset: int = 0,
    limit: int = 50,
    caller: Caller = operator,
) -> TenantList:
    _check_page(offset, limit)

    def read(session: Session) -> TenantList:
        rows, total = tenants.list_tenants(session, search=search, offset=offset, limit=limit)
        return TenantList(
            data=[TenantView.of(t) for t in rows], total=total, offset=offset, limit=limit
        )

    result: TenantList = await store.db.run(read)
    return result


@router.post("/tenants", response_model=TenantView, status_code=201)
async def create_tenant(service: TenantsDep, body: TenantCreate, caller: Caller = operator) -> Any:
    quotas = body.quotas or QuotasBody()
    tenant = await service.create(
        caller.id,
        body.name,
        display_name=body.display_name,
        quotas=tenants.Quotas(**quotas.model_dump()),
        scheduling=tenants.Scheduling(body.weight, body.max_priority),
    )
    return TenantView.of(tenant)


@router.get("/tenants/{tenant}", response_model=TenantView)
async def get_tenant(store: StoreDep, tenant: str, caller: Caller = operator) -> Any:
    return await store.db.run(lambda s: TenantView.of(tenants.require_tenant(s, tenant)))


@router.patch("/tenants/{tenant}", response_model=TenantView)
async def update_tenant(
    service: TenantsDep, tenant: str, body: TenantUpdate, caller: Caller = operator
) -> Any:
    """Change the fields given; ``status`` "suspended" refuses the tenant's keys from their next
    request, "active" resumes them; ``weight`` reaches the engine's scheduler at once, and
    ``max_priority`` applies from the tenant's next request."""
    changed_quotas = None
    if body.quotas is not None:
        changed_quotas = {f: getattr(body.quotas, f) for f in body.quotas.model_fields_set}
    change = await service.update(
        caller.id,
        tenant,
        display_name=body.display_name,
        status=body.status,
        quotas=changed_quotas,
        weight=body.weight,
        max_priority=body.max_priority,
    )
    return TenantView.of(change.tenant)


@router.delete("/tenants/{tenant}", response_model=Deleted)
async def delete_tenant(service: TenantsDep, tenant: str, caller: Caller = operator) -> Deleted:
    """The tenant, its keys, adapters and usage rows; its audit events stay."""
    await service.delete(caller.id, tenant)
    return Deleted(id=tenant, object="tenant")


# ---- keys --------------------------------------------------------------------------------------


@router.post("/tenants/{tenant}/keys", response_model=NewKeyView, status_code=201)
async def create_key(
    store: StoreDep, tenant: str, body: KeyCreate, caller: Caller = operator
) -> Any:
    """A new key; the response's ``key`` is the only time the secret is shown."""
    now = utcnow()
    if body.expires_at is not None and body.expires_at <= now:
        raise APIError(
            400,
            "expires_at is in the past; give a future time (with a time zone), or leave it out "
            "for a key that does not expire.",
            param="expires_at",
            code="invalid_expiry",
        )
    if body.expires_at is not None and body.expires_at >= MAX_EXPIRES_AT:
        raise APIError(
            400,
            f"expires_at must be before {MAX_EXPIRES_AT.date()} (UTC); leave it out for a key "
            "that does not expire.",
            param="expires_at",
            code="invalid_expiry",
        )

    def create(session: Session) -> NewKeyView:
        row = tenants.require_tenant(session, tenant)
        key, new = tenants.create_key(
            session,
            caller.id,
            row,
            name=body.name,
            scopes=body.scopes if body.scopes is not None else tenants.DEFAULT_KEY_SCOPES,
            expires_at=body.expires_at,
            allowed_models=body.allowed_models,
        )
        return NewKeyView(**KeyView.of(key, now).model_dump(exclude={"object"}), key=new.token)

    return await store.db.run(create)


@router.get("/tenants/{tenant}/keys", response_model=KeyList)
async def list_keys(store: StoreDep, tenant: str, caller: Caller = operator) -> Any:
    now = utcnow()

    def read(session: Session) -> KeyList:
        row = tenants.require_tenant(session, tenant)
        return KeyList(data=[KeyView.of(k, now) for k in tenants.list_keys(session, row)])

    return await store.db.run(read)


@router.patch("/tenants/{tenant}/keys/{public_id}", response_model=KeyView)
async def update_key(
    store: StoreDep, tenant: str, public_id: str, body: KeyUpdate, caller: Caller = operator
) -> Any:
    """Rename a key or change the models it may use (``allowed_models``: a list, or null for
    every model); applies from the key's next request."""
    given = body.model_fields_set

    def update(session: Session) -> KeyView:
        row = tenants.require_tenant(session, tenant)
        key = tenants.update_key(
            session,
            caller.id,
            row,
            public_id,
            name=body.name,
            allowed_models=body.allowed_models if "allowed_models" in given else tenants.UNCHANGED,
        )
        return KeyView.of(key, utcnow())

    return await store.db.run(update)


@router.delete("/tenants/{tenant}/keys/{public_id}", response_model=KeyView)
async def revoke_key(
    store: StoreDep, tenant: str, public_id: str, caller: Caller = operator
) -> Any:
    """Revoke (idempotent): the key is refused from its next request on."""

    def revoke(session: Session) -> KeyView:
        row = tenants.require_tenant(session, tenant)
        return KeyView.of(tenants.revoke_key(session, caller.id, row, public_id), utcnow())

    return await store.db.run(revoke)


# ---- usage, audit, engine ----------------------------------------------------------------------


@router.get("/tenants/{tenant}/usage", response_model=usage.UsageReport)
async def tenant_usage(
    store: StoreDep,
    recorder: UsageDep,
    tenant: str,
    start: str | None = None,
    end: str | None = None,
    caller: Caller = operator,
) -> Any:
    """One tenant's usage by day and model (``start``/``end``: UTC days, both included)."""
    days = usage.parse_range(start, end)
    await recorder.flush()  # read your own writes: the rows still buffered count too

    def read(session: Session) -> usage.UsageReport:
        row = tenants.require_tenant(session, tenant)
        return usage.tenant_usage(session, row.id, days)

    return await store.db.run(read)


@router.get("/usage", response_model=usage.UsageReport)
async def all_usage(
    store: StoreDep,
    recorder: UsageDep,
    start: str | None = None,
    end: str | None = None,
    caller: Caller = operator,
) -> Any:
    """Every tenant's usage by day, tenant and model."""
    days = usage.parse_range(start, end)
    await recorder.flush()  # read your own writes: the rows still buffered count too
    return await store.db.run(partial(usage.all_usage, days=days))


@router.get("/audit")
async def audit_log(
    store: StoreDep,
    tenant: str | None = None,
    action: str | None = Query(None, description="exact, or a prefix: 'key.' or 'key.*'"),
    actor: str | None = None,
    since: str | None = Query(None, description="ISO 8601 time or date (UTC if no zone)"),
    until: str | None = Query(None, description="exclusive"),
    before_id: int | None = Query(None, description="next_before_id of the previous page"),
    limit: int = 100,
    caller: Caller = operator,
) -> dict[str, Any]:
    """The audit log, newest first, in pages of at most 500 (keyset pagination)."""
    filters = audit.parse_filter(
        tenant=tenant, action=action, actor=actor, since=since, until=until
    )
    result: dict[str, Any] = await store.db.run(
        partial(audit.page, filters=filters, limit=limit, before_id=before_id)
    )
    return result


@router.get("/engine")
async def engine_state(
    client: ClientDep, store: StoreDep, caller: Caller = operator
) -> dict[str, Any]:
    """The engine now: running and waiting requests, KV cache use, prefix-cache hit rate,
    adapters per tier (device slots, host cache, registered), speculative decoding's counters
    and acceptance rate, each tenant's share (the fair
    policy's counter, tokens served, requests, weight; by tenant id, with its name), and the
    whole snapshot. 503 with the reason when the engine does not answer."""
    try:
        stats = await read_engine_stats(client)
    except EngineNotAnswering as exc:
        raise engine_unavailable(exc.reason) from None
    names = await store.db.run(partial(tenants.tenant_names, ids=list(stats.tenants)))
    lora = stats.lora
    spec = stats.speculative
    return {
        "object": "engine",
        "healthy": True,
        "dtype": client.info.dtype,
        "dtype_reason": client.info.dtype_reason,
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_total": stats.kv_blocks_total,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "num_preemptions": stats.num_preemptions,
        "adapters": {
            "device": lora.resident_device if lora else None,
            "host": lora.resident_host if lora else None,
            "registered": lora.registered if lora else None,
        },
        # speculative decoding: None when off
        "speculative": None
        if spec is None
        else dataclasses.asdict(spec) | {"acceptance_rate": spec.acceptance_rate},
        "tenants": [
            {"tenant_id": tid, "name": names.get(tid)} | dataclasses.asdict(share)
            for tid, share in sorted(stats.tenants.items())
        ],
        "stats": dataclasses.asdict(stats) | {"prefix_cache_hit_rate": stats.prefix_cache_hit_rate},
    }
