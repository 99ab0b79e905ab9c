"""Tenants and their API keys: create, change, suspend, delete, issue and revoke keys.

Shared by the admin API, the admin UI and the ``loraplex admin`` CLI. Each function works inside
the caller's session (one transaction) and writes its audit event there; ``TenantService`` adds
what a change means for the running server (quotas, adapter files, the engine's scheduling
weights). Bad input raises ``APIError`` with a message that says what to change; the CLI prints
the same message.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import logging
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from loraplex.config import PRIORITY_RANGE, TENANT_WEIGHT_RANGE
from loraplex.engine.client import EngineDeadError
from loraplex.platform import audit
from loraplex.platform.auth import SCOPE_ADAPTERS_WRITE, SCOPE_INFERENCE
from loraplex.platform.db.models import ApiKey, Tenant, utcnow
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.errors import NOT_FOUND, APIError
from loraplex.platform.keys import NewKey, generate_key
from loraplex.platform.model_access import check_allowed_models

if TYPE_CHECKING:
    from loraplex.engine.client import EngineClient
    from loraplex.platform.db.database import Database
    from loraplex.platform.quotas import QuotaManager
    from loraplex.platform.registry.service import Registry

logger = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
TENANT_SCOPES = (SCOPE_INFERENCE, SCOPE_ADAPTERS_WRITE)
DEFAULT_KEY_SCOPES = (SCOPE_INFERENCE, SCOPE_ADAPTERS_WRITE)
QUOTA_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "max_adapters",
)


TENANT_STATUSES = ("active", "suspended")
MIN_WEIGHT, MAX_WEIGHT = TENANT_WEIGHT_RANGE
# A running server re-reads the weights this often (the admin API pushes its changes at once;
# this picks up the CLI's, made on the database directly).
WEIGHT_REFRESH_S = 10.0


@dataclass(frozen=True)
class Scheduling:
    """How the engine schedules a tenant: ``weight``, its share when backlogged (fair
    policy; 1 = an equal share), and ``max_priority``, the most urgent (lowest) request
    priority it may ask for (0: none ahead of the default)."""

    weight: float = 1.0
    max_priority: int = 0


def check_weight(value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not MIN_WEIGHT <= value <= MAX_WEIGHT  # also refuses nan
    ):
        raise APIError(
            400,
            f"weight must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g} (1 = an equal "
            f"share of the engine, 2 twice that); got {str(value)[:40]}.",
            param="weight",
            code="invalid_weight",
        )
    return float(value)


def check_priority(value: object, param: str = "max_priority") -> int:
    low, high = PRIORITY_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise APIError(
            400,
            f"{param} must be a whole number from {low} to {high} (lower runs earlier); got "
            f"{str(value)[:40]}.",
            param=param,
            code="invalid_priority",
        )
    return value


@dataclass(frozen=True)
class Quotas:
    """Per-tenant limits; None = unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_adapters: int | None = None


def check_tenant_name(name: str) -> str:
    if not TENANT_NAME.fullmatch(name):
        raise APIError(
            400,
            "A tenant name is 1-63 characters of lowercase letters, digits, '-' and '_', "
            "starting with a letter or digit (for example 'acme-corp').",
            param="name",
            code="invalid_tenant_name",
        )
    return name


def check_quota(field: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**12:
        raise APIError(
            400,
            f"{field} must be a whole number from 1 to 10^12, or null for no limit.",
            param=field,
            code="invalid_quota",
        )
    return value


def tenant_not_found(name: str) -> APIError:
    return APIError(
        404,
        f"No tenant named {name[:64]!r}; GET /admin/api/tenants lists them.",
        type=NOT_FOUND,
        param="tenant",
        code="tenant_not_found",
    )


def get_tenant(session: Session, name: str) -> Tenant | None:
    return session.scalars(select(Tenant).where(Tenant.name == name)).first()


def require_tenant(session: Session, name: str) -> Tenant:
    tenant = get_tenant(session, name)
    if tenant is None:
        raise tenant_not_found(name)
    return tenant


def list_tenants(
    session: Session, *, search: str = "", offset: int = 0, limit: int = 50
) -> tuple[list[Tenant], int]:
    """One page of tenants ordered by name, and how many match ``search`` in all."""
    query = select(Tenant)
    if search:
        # The search is literal text: LIKE's wildcards in it match only themselves.
        literal = search.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        pattern = f"%{literal}%"
        query = query.where(
            or_(
                Tenant.name.like(pattern, escape="\\"),
                func.lower(Tenant.display_name).like(pattern, escape="\\"),
            )
        )
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = session.scalars(query.order_by(Tenant.name).offset(offset).limit(limit))
    return list(rows), int(total)


def check_new_tenant_name(session: Session, name: str) -> str:
    """``name`` when a new tenant may take it: well formed (400) and not taken (409)."""
    check_tenant_name(name)
    if get_tenant(session, name) is not None:
        raise APIError(
            409,
            f"A tenant named {name!r} already exists; choose another name.",
            param="name",
            code="tenant_exists",
        )
    return name


def create_tenant(
    session: Session,
    actor: str,
    name: str,
    *,
    display_name: str = "",
    quotas: Quotas = Quotas(),
    scheduling: Scheduling = Scheduling(),
) -> Tenant:
    check_new_tenant_name(session, name)
    tenant = Tenant(
        name=name,
        display_name=display_name[:200],
        status="active",
        cache_salt=secrets.token_hex(16),
        weight=check_weight(scheduling.weight),
        max_priority=check_priority(scheduling.max_priority),
        **{f: check_quota(f, getattr(quotas, f)) for f in QUOTA_FIELDS},
    )
    session.add(tenant)
    session.flush()
    audit.record(
        session, actor, "tenant.create", "tenant", name, tenant_name=name,
        after=audit.snapshot(tenant),
    )  # fmt: skip
    return tenant


def update_tenant(
    session: Session,
    actor: str,
    tenant: Tenant,
    *,
    display_name: str | None = None,
    status: str | None = None,
    quotas: dict[str, int | None] | None = None,
    weight: float | None = None,
    max_priority: int | None = None,
) -> Tenant:
    """Change the given fields; ``quotas`` maps quota field names to a limit or None."""
    before = audit.snapshot(tenant)
    if weight is not None:
        tenant.weight = check_weight(weight)
    if max_priority is not None:
        tenant.max_priority = check_priority(max_priority)
    if display_name is not None:
        tenant.display_name = display_name[:200]
    if status is not None:
        if status not in TENANT_STATUSES:
            raise APIError(
                400, "status is 'active' or 'suspended'.", param="status", code="invalid_status"
            )
        tenant.status = status
    for field, value in (quotas or {}).items():
        if field not in QUOTA_FIELDS:
            raise APIError(
                400,
                f"Unknown quota {field!r}; quotas are {', '.join(QUOTA_FIELDS)}.",
                param=field,
                code="invalid_quota",
            )
        setattr(tenant, field, check_quota(field, value))
    session.flush()
    after = audit.snapshot(tenant)
    if after != before:
        action = "tenant.update"
        if before["status"] != after["status"]:
            action = "tenant.suspend" if after["status"] == "suspended" else "tenant.resume"
        audit.record(
            session, actor, action, "tenant", tenant.name, tenant_name=tenant.name,
            before=before, after=after,
        )  # fmt: skip
    return tenant


def delete_tenant(session: Session, actor: str, tenant: Tenant) -> None:
    """Delete the tenant's rows (keys, adapters, usage); its files are the registry's job."""
    before = audit.snapshot(tenant)
    session.delete(tenant)
    session.flush()
    audit.record(
        session, actor, "tenant.delete", "tenant", before["name"], tenant_name=before["name"],
        before=before,
    )  # fmt: skip


def check_scopes(scopes: Iterable[str]) -> list[str]:
    wanted = list(dict.fromkeys(scopes))
    bad = [s for s in wanted if s not in TENANT_SCOPES]
    if bad or not wanted:
        raise APIError(
            400,
            f"Key scopes are a non-empty list drawn from {', '.join(TENANT_SCOPES)}"
            + (f"; {bad[0][:40]!r} is not one." if bad else "."),
            param="scopes",
            code="invalid_scope",
        )
    return wanted


def create_key(
    session: Session,
    actor: str,
    tenant: Tenant,
    *,
    name: str = "",
    scopes: Iterable[str] = DEFAULT_KEY_SCOPES,
    expires_at: dt.datetime | None = None,
    allowed_models: Iterable[str] | None = None,
) -> tuple[ApiKey, NewKey]:
    """A new key for ``tenant``; the returned ``NewKey.token`` is the only copy of the secret.
    ``allowed_models``: the only models it may use (``model_access``); None: every model."""
    scope_list = check_scopes(scopes)
    models = check_allowed_models(allowed_models)
    if expires_at is not None and expires_at.tzinfo is None:
        raise APIError(400, "expires_at needs a time zone.", param="expires_at")
    new = generate_key()
    key = TenantScope(session, tenant.id).add(
        ApiKey(
            name=name[:100],
            public_id=new.public_id,
            secret_sha256=new.secret_sha256,
            last4=new.last4,
            scopes=scope_list,
            expires_at=expires_at,
            allowed_models=models,
        )
    )
    session.flush()
    audit.record(
        session, actor, "key.create", "api_key", new.public_id, tenant_name=tenant.name,
        after=audit.snapshot(key),
    )  # fmt: skip
    return key, new


def list_keys(session: Session, tenant: Tenant) -> list[ApiKey]:
    return list(session.scalars(TenantScope(session, tenant.id).select(ApiKey).order_by(ApiKey.id)))


def key_not_found(public_id: str) -> APIError:
    return APIError(
        404,
        f"No API key {public_id[:40]!r} for this tenant; list the tenant's keys to find it.",
        type=NOT_FOUND,
        param="key",
        code="key_not_found",
    )


class Unchanged(enum.Enum):
    """``update_key``'s default: leave the field as it is (None means every model)."""

    UNCHANGED = "unchanged"


UNCHANGED = Unchanged.UNCHANGED


def update_key(
    session: Session,
    actor: str,
    tenant: Tenant,
    public_id: str,
    *,
    name: str | None = None,
    allowed_models: Iterable[str] | Unchanged | None = UNCHANGED,
) -> ApiKey:
    """Rename a key or change its model allowlist (None: every model); applies from the key's
    next request. Audited as ``key.update`` when anything changed."""
    key = TenantScope(session, tenant.id).key(public_id)
    if key is None:
        raise key_not_found(public_id)
    before = audit.snapshot(key)
    if name is not None:
        key.name = name[:100]
    if not isinstance(allowed_models, Unchanged):
        key.allowed_models = check_allowed_models(allowed_models)
    session.flush()
    after = audit.snapshot(key)
    if after != before:
        audit.record(
            session, actor, "key.update", "api_key", public_id, tenant_name=tenant.name,
            before=before, after=after,
        )  # fmt: skip
    return key


def revoke_key(session: Session, actor: str, tenant: Tenant, public_id: str) -> ApiKey:
    """Revoke (idempotently); the key fails authentication from its next request on."""
    key = TenantScope(session, tenant.id).key(public_id)
    if key is None:
        raise key_not_found(public_id)
    if key.revoked_at is None:
        before = audit.snapshot(key)
        key.revoked_at = utcnow()
        session.flush()
        audit.record(
            session, actor, "key.revoke", "api_key", public_id, tenant_name=tenant.name,
            before=before, after=audit.snapshot(key),
        )  # fmt: skip
    return key


# ---- the service: changes with effects beyond their rows -----------------------------------


@dataclass(frozen=True)
class TenantChange:
    tenant: Tenant  # the row after the change (detached, loaded)
    changed: bool  # whether any field changed


class TenantService:
    """Tenant changes that reach beyond the database, as one call each: an update commits,
    then its quotas and status apply from the tenant's next request; a deletion commits, then
    the tenant's quota state goes and its adapters' files and engine copies with it (the
    registry's collection). The admin API and the admin UI call these, never the effects."""

    def __init__(
        self, db: Database, quotas: QuotaManager, registry: Registry, client: EngineClient
    ) -> None:
        self.db = db
        self.quotas = quotas
        self.registry = registry
        self.client = client  # the engine, told each tenant's scheduling weight
        self._pushed: dict[str, float] | None = None  # the weights the engine was last sent

    async def update(
        self,
        actor: str,
        name: str,
        *,
        display_name: str | None = None,
        status: str | None = None,
        quotas: dict[str, int | None] | None = None,
        weight: float | None = None,
        max_priority: int | None = None,
    ) -> TenantChange:
        def work(session: Session) -> TenantChange:
            tenant = require_tenant(session, name)
            before = audit.snapshot(tenant)
            update_tenant(
                session, actor, tenant, display_name=display_name, status=status, quotas=quotas,
                weight=weight, max_priority=max_priority,
            )  # fmt: skip
            return TenantChange(tenant, audit.snapshot(tenant) != before)

        change = await self.db.run(work)
        self.quotas.invalidate(change.tenant.id)
        if weight is not None:
            await self.push_weights()
        return change

    async def create(
        self,
        actor: str,
        name: str,
        *,
        display_name: str = "",
        quotas: Quotas = Quotas(),
        scheduling: Scheduling = Scheduling(),
    ) -> Tenant:
        tenant = await self.db.run(
            lambda s: create_tenant(
                s, actor, name, display_name=display_name, quotas=quotas, scheduling=scheduling
            )
        )
        if scheduling.weight != Scheduling().weight:
            await self.push_weights()
        return tenant

    async def push_weights(self, *, only_changed: bool = False) -> None:
        """Tell the engine every tenant's weight: it applies them from its next step. A dead
        engine gets them when it comes back (the client re-sends the last ones)."""
        weights = await self.db.run(tenant_weights)
        if only_changed and weights == self._pushed:
            return
        try:
            await self.client.set_tenant_weights(weights)
        except EngineDeadError:
            logger.warning("the engine is down; it gets the tenants' weights when it restarts")
            return
        self._pushed = weights

    async def refresh_weights_forever(self, interval_s: float = WEIGHT_REFRESH_S) -> None:
        """Push the weights whenever the database's differ from the engine's (the CLI's
        changes), every ``interval_s``; runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.push_weights(only_changed=True)
            except Exception:  # a database hiccup: the next round tries again
                logger.exception("refreshing the tenants' scheduling weights failed")

    async def delete(self, actor: str, name: str) -> None:
        """The tenant, its keys, adapters and usage rows (its audit events stay)."""

        def work(session: Session) -> int:
            tenant = require_tenant(session, name)
            tenant_id = tenant.id
            delete_tenant(session, actor, tenant)
            return tenant_id

        tenant_id = await self.db.run(work)
        self.quotas.forget(tenant_id)
        try:  # the engine forgets its weight (else the next refresh tells it)
            await self.push_weights(only_changed=True)
        except Exception:
            logger.exception("telling the engine the weights after deleting %s failed", name)
        try:  # a failure waits for the next collection: nothing names those files any more
            await self.registry.collect_garbage()
        except Exception:
            logger.exception("removing the adapters of deleted tenant %s failed", name)


def tenant_weights(session: Session) -> dict[str, float]:
    """Every tenant's scheduling weight, by the id the engine knows it by (``Caller.tenant_id``).
    A row written before the range narrowed (up to 1000, or any number above 0) is clamped into
    it, so one old row cannot make the engine refuse every tenant's weight."""
    rows = session.execute(select(Tenant.id, Tenant.weight))
    return {str(tid): min(max(float(w), MIN_WEIGHT), MAX_WEIGHT) for tid, w in rows}


def tenant_names(session: Session, ids: Iterable[str]) -> dict[str, str]:
    """The names of the tenants with these ids (as the engine knows them: ``str(tenant.id)``);
    an id of no tenant (a deleted one, ``-`` for the operator) is left out."""
    wanted = [int(i) for i in ids if i.isascii() and i.isdigit()]
    rows = session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(wanted)))
    return {str(tid): name for tid, name in rows}
