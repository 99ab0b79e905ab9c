"""Webhook rows: subscriptions, events (each once) and deliveries (claimed before sending).

    record_event     an alert -> one ``WebhookEvent`` (its ``event_id`` is derived from what
                     happened: a second replica's insert of it fails the unique key) and one
                     pending ``WebhookDelivery`` per subscription to its kind
    claim_due        pending deliveries due now whose claim (if any) has lapsed -> claimed by
                     this replica with one conditional UPDATE each (``claimed_until`` ahead):
                     on PostgreSQL a concurrent claimer re-reads the row and matches nothing
    finish           the attempt's outcome: succeeded, or pending again after a backoff
                     (``retry_base_s`` x 2^(attempts-1)), or failed after ``max_attempts``

A replica that dies mid-attempt leaves a claim that lapses after ``lease_s``; another replica
sends it again (so a receiver deduplicates by the event id, which never changes).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, delete, or_, select, update
from sqlalchemy.orm import Session

from loraplex.platform import audit
from loraplex.platform.db.models import (
    ApiKey,
    Tenant,
    Webhook,
    WebhookDelivery,
    WebhookEvent,
    utcnow,
)
from loraplex.platform.errors import NOT_FOUND, APIError, clip
from loraplex.platform.webhooks.sender import check_url
from loraplex.platform.webhooks.signing import new_secret

# The alerts a subscription can ask for, and what each means (docs, the UI, the CLI).
EVENT_TYPES: dict[str, str] = {
    "budget.soft_limit_crossed": "a budget's soft limit was crossed (once per budget and period)",
    "budget.hard_limit_reached": "a budget was spent: its next requests are refused",
    "quota.exhausted": "a tenant's per-minute quota refused many requests in one window",
    "adapter.validation_failed": "an adapter upload was refused by validation",
    "adapter.load_failed": "the engine failed to load an adapter version",
    "engine.restarted": "a replica's engine process restarted",
    "key.expiring": "an API key expires soon",
}
TEST_EVENT = "webhook.test"  # only sent by a test-send, to the one subscription
MAX_EVENTS = len(EVENT_TYPES)
MAX_DESCRIPTION = 200


def event_id_of(dedup_key: str) -> str:
    """The public id of the alert ``dedup_key`` names: the same on every replica."""
    return "evt_" + hashlib.sha256(dedup_key.encode()).hexdigest()[:32]


def body_of(event: WebhookEvent) -> bytes:
    """The delivered JSON body: the same bytes on every attempt."""
    return json.dumps(event.payload, separators=(",", ":"), sort_keys=True).encode()


# ---- subscriptions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class WebhookView:
    id: int
    url: str
    events: list[str]
    description: str
    created_at: dt.datetime

    @classmethod
    def of(cls, row: Webhook) -> WebhookView:
        return cls(row.id, row.url, list(row.events), row.description, row.created_at)

    def snapshot(self) -> dict[str, Any]:
        """For the audit log (never the secret)."""
        return {"url": self.url, "events": self.events, "description": self.description}


def check_events(events: list[str]) -> list[str]:
    known = ", ".join(EVENT_TYPES)
    if not events:
        raise APIError(400, f"events is empty; name at least one of: {known}.", param="events")
    unknown = [e for e in events if e not in EVENT_TYPES]
    if unknown:
        raise APIError(
            400,
            f"Unknown event {clip(unknown[0], 60)} in events; the events are: {known}.",
            param="events",
            code="unknown_event",
        )
    return list(dict.fromkeys(events))


def create_webhook(
    session: Session, actor: str, url: str, events: list[str], description: str = ""
) -> tuple[WebhookView, str]:
    """A new subscription and its secret (the only time the secret leaves the database)."""
    problem = check_url(url)
    if problem is not None:
        raise APIError(400, f"{problem[0].upper()}{problem[1:]}.", param="url", code="invalid_url")
    if len(description) > MAX_DESCRIPTION:
        raise APIError(
            400, f"description is longer than {MAX_DESCRIPTION} characters; shorten it.",
            param="description",
        )  # fmt: skip
    secret = new_secret()
    row = Webhook(url=url, events=check_events(events), secret=secret, description=description)
    session.add(row)
    session.flush()
    view = WebhookView.of(row)
    audit.record(session, actor, "webhook.create", "webhook", str(row.id), after=view.snapshot())
    return view, secret


def webhook_not_found(webhook_id: object) -> APIError:
    return APIError(
        404,
        f"There is no webhook {clip(webhook_id, 40)}; GET /admin/api/webhooks lists them.",
        type=NOT_FOUND,
        code="webhook_not_found",
    )


def require_webhook(session: Session, webhook_id: int) -> Webhook:
    row = session.get(Webhook, webhook_id)
    if row is None:
        raise webhook_not_found(webhook_id)
    return row


def delete_webhook(session: Session, actor: str, webhook_id: int) -> WebhookView:
    """The subscription and its deliveries (its audit events stay)."""
    row = require_webhook(session, webhook_id)
    view = WebhookView.of(row)
    session.delete(row)
    audit.record(session, actor, "webhook.delete", "webhook", str(webhook_id),
                 before=view.snapshot())  # fmt: skip
    return view


def list_webhooks(session: Session) -> list[WebhookView]:
    return [WebhookView.of(w) for w in session.scalars(select(Webhook).order_by(Webhook.id))]


# ---- events and deliveries ---------------------------------------------------------------------


def record_event(
    session: Session,
    kind: str,
    dedup_key: str,
    data: dict[str, Any],
    now: float,
    *,
    only_webhook: int | None = None,
) -> str | None:
    """Record the alert and queue its deliveries; None when it was recorded before. A
    concurrent insert of the same alert raises ``IntegrityError`` (the caller's "before")."""
    event_id = event_id_of(dedup_key)
    if session.scalar(select(WebhookEvent.id).where(WebhookEvent.event_id == event_id)):
        return None
    created = utcnow()
    payload = {"id": event_id, "type": kind, "created_at": created.isoformat(), "data": data}
    event = WebhookEvent(event_id=event_id, kind=kind, payload=payload, created_at=created)
    session.add(event)
    session.flush()
    if only_webhook is not None:
        targets = [only_webhook]
    else:
        targets = [w.id for w in session.scalars(select(Webhook)) if kind in w.events]
    for webhook_id in targets:
        session.add(WebhookDelivery(event_id=event.id, webhook_id=webhook_id, next_attempt_at=now))
    return event_id


@dataclass(frozen=True)
class Claim:
    """A delivery this replica sends now."""

    delivery_id: int
    url: str
    secret: str
    event_id: str
    kind: str
    body: bytes
    attempt: int  # 1 for the first


def claim_due(
    session: Session, replica: str, now: float, limit: int, lease_s: float
) -> list[Claim]:
    lapsed = or_(WebhookDelivery.claimed_until.is_(None), WebhookDelivery.claimed_until < now)
    due = and_(WebhookDelivery.state == "pending", WebhookDelivery.next_attempt_at <= now, lapsed)
    ids = list(session.scalars(
        select(WebhookDelivery.id).where(due).order_by(WebhookDelivery.next_attempt_at).limit(limit)
    ))  # fmt: skip
    claims = []
    for delivery_id in ids:
        taken = session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == delivery_id, due)
            .values(
                claimed_until=now + lease_s,
                claimed_by=replica,
                attempts=WebhookDelivery.attempts + 1,
            )
            .execution_options(synchronize_session=False)
        )
        if getattr(taken, "rowcount", 0) != 1:  # another replica claimed it first
            continue
        delivery = session.get(WebhookDelivery, delivery_id, populate_existing=True)
        webhook = session.get(Webhook, delivery.webhook_id) if delivery else None
        event = session.get(WebhookEvent, delivery.event_id) if delivery else None
        if delivery is None or webhook is None or event is None:
            continue  # deleted meanwhile
        claims.append(
            Claim(
                delivery.id,
                webhook.url,
                webhook.secret,
                event.event_id,
                event.kind,
                body_of(event),
                delivery.attempts,
            )
        )
    return claims


def finish(
    session: Session,
    claim: Claim,
    *,
    status: int | None,
    error: str | None,
    duration_ms: float,
    now: float,
    max_attempts: int,
    retry_base_s: float,
) -> str:
    """Record an attempt's outcome; returns the delivery's state ("deleted": its subscription
    went meanwhile)."""
    attempts = session.scalar(
        select(WebhookDelivery.attempts).where(WebhookDelivery.id == claim.delivery_id)
    )
    if attempts is None:
        return "deleted"
    values: dict[str, Any] = {
        "last_status": status, "last_error": error, "last_duration_ms": duration_ms,
        "last_attempt_at": utcnow(), "claimed_until": None, "claimed_by": None,
    }  # fmt: skip
    if error is None:
        values |= {"state": "succeeded", "finished_at": utcnow()}
    elif attempts >= max_attempts:
        values |= {"state": "failed", "finished_at": utcnow()}
    else:
        values |= {"state": "pending", "next_attempt_at": now + retry_base_s * 2 ** (attempts - 1)}
    done = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == claim.delivery_id)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return str(values["state"]) if getattr(done, "rowcount", 0) == 1 else "deleted"


@dataclass(frozen=True)
class DeliveryView:
    id: int
    webhook_id: int
    url: str
    event_id: str
    kind: str
    state: str
    attempts: int
    last_status: int | None
    last_error: str | None
    last_duration_ms: float | None
    created_at: dt.datetime
    last_attempt_at: dt.datetime | None
    finished_at: dt.datetime | None
    next_attempt_at: dt.datetime | None  # pending only


def deliveries(
    session: Session, *, webhook_id: int | None = None, limit: int = 50
) -> list[DeliveryView]:
    """The newest deliveries first."""
    query = (
        select(WebhookDelivery, WebhookEvent, Webhook)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
        .order_by(WebhookDelivery.id.desc())
        .limit(limit)
    )
    if webhook_id is not None:
        query = query.where(WebhookDelivery.webhook_id == webhook_id)
    views = []
    for d, e, w in session.execute(query).tuples():
        retry = None
        if d.state == "pending":
            retry = dt.datetime.fromtimestamp(d.next_attempt_at, dt.timezone.utc)
        views.append(
            DeliveryView(
                d.id,
                w.id,
                w.url,
                e.event_id,
                e.kind,
                d.state,
                d.attempts,
                d.last_status,
                d.last_error,
                d.last_duration_ms,
                d.created_at,
                d.last_attempt_at,
                d.finished_at,
                retry,
            )
        )
    return views


def purge(session: Session, before: dt.datetime) -> int:
    """Delete the events recorded before ``before`` and their deliveries; how many events."""
    ids = list(session.scalars(select(WebhookEvent.id).where(WebhookEvent.created_at < before)))
    if ids:
        session.execute(delete(WebhookDelivery).where(WebhookDelivery.event_id.in_(ids)))
        session.execute(delete(WebhookEvent).where(WebhookEvent.id.in_(ids)))
    return len(ids)


def tenant_name(session: Session, tenant_id: int) -> str | None:
    tenant = session.get(Tenant, tenant_id)
    return tenant.name if tenant is not None else None


def expiring_keys(
    session: Session, now: dt.datetime, within: dt.timedelta
) -> list[tuple[str, ApiKey]]:
    """(tenant name, key) of the unrevoked keys expiring in ``(now, now + within]``."""
    query = (
        select(Tenant.name, ApiKey)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(
            ApiKey.revoked_at.is_(None), ApiKey.expires_at > now, ApiKey.expires_at <= now + within
        )
        .order_by(ApiKey.expires_at)
    )
    return [(name, key) for name, key in session.execute(query).tuples()]
