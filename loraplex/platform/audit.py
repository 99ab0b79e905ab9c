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
from loraplex.platform.errors import APIError

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
        "weight",
        "max_priority",
    ),
    ApiKey: ("name", "public_id", "last4", "scopes", "allowed_models", "expires_at", "revoked_at"),
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


# ---- the admin API's view ----------------------------------------------------------------------

MAX_PAGE = 500
MAX_EVENT_ID = 2**63 - 1  # the largest id SQLite (and PostgreSQL's bigint) can compare against
# The times a filter may name (UTC), so that no conversion or day arithmetic on them overflows.
FIRST_TIME = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
LAST_TIME = dt.datetime(9999, 12, 30, 23, 59, 59, tzinfo=dt.timezone.utc)


def parse_time(value: str | None, param: str) -> dt.datetime | None:
    """An ISO 8601 time or date from a query string (no zone: UTC), in UTC; 400 when malformed
    or outside ``FIRST_TIME`` to ``LAST_TIME``."""
    if value is None or value == "":
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=dt.timezone.utc)
        parsed = parsed.astimezone(dt.timezone.utc)  # OverflowError past year 1 or 9999
        if not FIRST_TIME <= parsed <= LAST_TIME:
            raise ValueError(value)
    except (ValueError, OverflowError):
        raise APIError(
            400,
            f"{param} must be an ISO 8601 time such as '2025-01-31T12:00:00Z' or a date such "
            f"as '2025-01-31' (UTC), from {FIRST_TIME.date()} to {LAST_TIME.date()}; got "
            f"{value[:40]!r}.",
            param=param,
            code="invalid_time",
        ) from None
    return parsed


def parse_filter(
    *,
    tenant: str | None = None,
    action: str | None = None,
    actor: str | None = None,
    since: str | None = None,
    until: str | None = None,
) -> AuditFilter:
    """An ``AuditFilter`` from query values; ``action`` "key.*" is the prefix "key."."""
    if action is not None and action.endswith(".*"):
        action = action[:-1]
    return AuditFilter(
        tenant_name=tenant or None,
        action=action or None,
        actor=actor or None,
        since=parse_time(since, "since"),
        until=parse_time(until, "until"),
    )


def check_page(limit: int, before_id: int | None) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise APIError(
            400, f"limit must be from 1 to {MAX_PAGE}; got {limit}.", param="limit",
            code="invalid_limit",
        )  # fmt: skip
    if before_id is not None and not 1 <= before_id <= MAX_EVENT_ID:
        raise APIError(
            400,
            f"before_id must be an event id from 1 to {MAX_EVENT_ID}: the next_before_id of the "
            "previous page.",
            param="before_id",
            code="invalid_cursor",
        )


def event_view(event: AuditEvent) -> dict[str, Any]:
    """The JSON of one event for the admin API (snapshots hold no secrets, no paths)."""
    return {
        "id": event.id,
        "object": "audit_event",
        "created_at": event.created_at.isoformat(),
        "actor": event.actor,
        "tenant": event.tenant_name,
        "action": event.action,
        "object_type": event.object_type,
        "object_id": event.object_id,
        "before": event.before,
        "after": event.after,
        "ip": event.ip,
    }


def page(
    session: Session, filters: AuditFilter, *, limit: int = 100, before_id: int | None = None
) -> dict[str, Any]:
    """One page, newest first: ``{"data": [...], "has_more", "next_before_id"}``; pass
    ``next_before_id`` as ``before_id`` for the next (older) page."""
    check_page(limit, before_id)
    rows = events(session, filters, limit=limit + 1, before_id=before_id)
    more = len(rows) > limit
    rows = rows[:limit]
    return {
        "object": "list",
        "data": [event_view(e) for e in rows],
        "has_more": more,
        "next_before_id": rows[-1].id if more and rows else None,
    }
