"""The audit log: one ``AuditEvent`` row for every change, by the operator or by a tenant.

``record`` joins the caller's transaction, so a change and its audit row commit (or roll back)
together. Secrets never enter ``before``/``after``: callers pass the ``snapshot`` of a row.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from loraplex.platform.db.models import (
    Adapter,
    AdapterVersion,
    ApiKey,
    AuditEvent,
    Tenant,
)

ADMIN_ACTOR = "admin"

_SNAPSHOT_FIELDS: dict[type[Any], tuple[str, ...]] = {
    Tenant: (
        "name",
        "display_name",
        "status",
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent_requests",
        "max_adapters",
    ),
    ApiKey: ("name", "public_id", "last4", "scopes", "expires_at", "revoked_at"),
    Adapter: ("name", "description"),
    AdapterVersion: (
        "number",
        "content_sha256",
        "rank",
        "alpha",
        "target_modules",
        "size_bytes",
        "status",
    ),
}


def snapshot(row: Any) -> dict[str, Any]:
    """The audit-safe fields of ``row`` as JSON values (no secrets, no paths)."""
    fields = _SNAPSHOT_FIELDS[type(row)]
    out: dict[str, Any] = {}
    for name in fields:
        value = getattr(row, name)
        out[name] = value.isoformat() if isinstance(value, dt.datetime) else value
    return out


def record(
    session: Session,
    actor: str,
    action: str,
    object_type: str,
    object_id: str,
    *,
    tenant_name: str | None = None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    ip: str | None = None,
) -> AuditEvent:
    event = AuditEvent(
        actor=actor[:200],
        tenant_name=tenant_name,
        action=action,
        object_type=object_type,
        object_id=object_id[:200],
        before=before,
        after=after,
        ip=ip,
    )
    session.add(event)
    return event


@dataclass(frozen=True)
class AuditFilter:
    tenant_name: str | None = None
    action: str | None = None  # exact, or a prefix ending in "." ("key." = every key action)
    actor: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None

    def apply(self, query: Select[AuditEvent]) -> Select[AuditEvent]:
        if self.tenant_name is not None:
            query = query.where(AuditEvent.tenant_name == self.tenant_name)
        if self.action:
            if self.action.endswith("."):
                query = query.where(AuditEvent.action.startswith(self.action, autoescape=True))
            else:
                query = query.where(AuditEvent.action == self.action)
        if self.actor is not None:
            query = query.where(AuditEvent.actor == self.actor)
        if self.since is not None:
            query = query.where(AuditEvent.created_at >= self.since)
        if self.until is not None:
            query = query.where(AuditEvent.created_at < self.until)
        return query


def events(
    session: Session, filters: AuditFilter, *, limit: int = 100, before_id: int | None = None
) -> list[AuditEvent]:
    """Newest first; ``before_id`` pages backwards (keyset pagination, fast on a long log)."""
    query = filters.apply(select(AuditEvent))
    if before_id is not None:
        query = query.where(AuditEvent.id < before_id)
    return list(session.scalars(query.order_by(AuditEvent.id.desc()).limit(limit)))
