"""Alert webhooks over HTTP, for the operator (audience "operator")::

    GET    /admin/api/webhooks                       the subscriptions (never their secrets)
    POST   /admin/api/webhooks                       a new one; its secret is answered once
    GET    /admin/api/webhooks/deliveries            recent deliveries, newest first, with their
                                                     outcome (?webhook_id=, ?limit=)
    GET    /admin/api/webhooks/{webhook_id}
    DELETE /admin/api/webhooks/{webhook_id}          with its deliveries
    POST   /admin/api/webhooks/{webhook_id}/test     queue a ``webhook.test`` delivery (202)

Changes are audited (``webhook.create``, ``webhook.delete``) in their transaction.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from loraplex.platform.access import operator_caller
from loraplex.platform.api.bodies import StrictBody
from loraplex.platform.auth import SCOPE_ADMIN, Caller
from loraplex.platform.deps import TenancyDep
from loraplex.platform.webhooks import store
from loraplex.platform.webhooks.redact import viewer_error, viewer_url
from loraplex.platform.webhooks.service import WebhookService

router = APIRouter(prefix="/admin/api", tags=["admin"])
operator = Depends(operator_caller)
MAX_DELIVERIES = 500


def _webhooks(tenancy: TenancyDep) -> WebhookService:
    return tenancy.webhooks


WebhooksDep = Annotated[WebhookService, Depends(_webhooks)]

_EVENTS = "the alerts to send: " + ", ".join(store.EVENT_TYPES)


class WebhookCreate(StrictBody):
    url: str = Field(description="http:// or https://; redirects are not followed")
    events: list[str] = Field(description=_EVENTS)
    description: str = Field("", max_length=store.MAX_DESCRIPTION)


class WebhookOut(BaseModel):
    object: Literal["webhook"] = "webhook"
    id: str
    url: str
    events: list[str]
    description: str
    created_at: dt.datetime

    @classmethod
    def of(cls, view: store.WebhookView, *, viewer: bool = False) -> WebhookOut:
        url = viewer_url(view.url) if viewer else view.url
        return cls(id=str(view.id), url=url, events=view.events,
                   description=view.description, created_at=view.created_at)  # fmt: skip


class NewWebhookOut(WebhookOut):
    secret: str = Field(description="signs every delivery; shown this once, never again")


class WebhookList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookOut]


class DeliveryOut(BaseModel):
    object: Literal["webhook.delivery"] = "webhook.delivery"
    id: str
    webhook_id: str
    url: str
    event_id: str
    type: str
    state: str  # pending | succeeded | failed
    attempts: int
    last_status: int | None
    last_error: str | None
    last_duration_ms: float | None
    created_at: dt.datetime
    last_attempt_at: dt.datetime | None
    finished_at: dt.datetime | None
    next_attempt_at: dt.datetime | None

    @classmethod
    def of(cls, d: store.DeliveryView, *, viewer: bool = False) -> DeliveryOut:
        return cls(
            id=str(d.id), webhook_id=str(d.webhook_id),
            url=viewer_url(d.url) if viewer else d.url, event_id=d.event_id,
            type=d.kind, state=d.state, attempts=d.attempts, last_status=d.last_status,
            last_error=viewer_error(d.last_error) if viewer else d.last_error,
            last_duration_ms=d.last_duration_ms,
            created_at=d.created_at, last_attempt_at=d.last_attempt_at,
            finished_at=d.finished_at, next_attempt_at=d.next_attempt_at,
        )  # fmt: skip


class DeliveryList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DeliveryOut]


class TestQueued(BaseModel):
    object: Literal["webhook.test"] = "webhook.test"
    webhook_id: str
    event_id: str


class Deleted(BaseModel):
    id: str
    object: str = "webhook"
    deleted: bool = True


def webhook_number(webhook_id: str) -> int:
    """A webhook id from a path (one that is no number names no webhook: 404)."""
    if not webhook_id.isascii() or not webhook_id.isdigit() or len(webhook_id) > 12:
        raise store.webhook_not_found(webhook_id[:40])
    return int(webhook_id)


def _viewer(caller: Caller) -> bool:
    """The admin UI's read-only role (an operator credential without the admin scope): it sees
    receivers' origins only (``webhooks/redact.py``)."""
    return not caller.has_scope(SCOPE_ADMIN)


@router.get("/webhooks", response_model=WebhookList)
async def list_webhooks(tenancy: TenancyDep, caller: Caller = operator) -> WebhookList:
    views = await tenancy.store.db.run(store.list_webhooks)
    return WebhookList(data=[WebhookOut.of(v, viewer=_viewer(caller)) for v in views])


@router.post("/webhooks", response_model=NewWebhookOut, status_code=201)
async def create_webhook(
    tenancy: TenancyDep, body: WebhookCreate, caller: Caller = operator
) -> NewWebhookOut:
    """A subscription to ``events`` at ``url``; the answer's ``secret`` is the only time it
    is shown (verify each delivery's ``X-Loraplex-Signature`` with it)."""

    def create(session: Session) -> tuple[store.WebhookView, str]:
        return store.create_webhook(session, caller.id, body.url, body.events, body.description)

    view, secret = await tenancy.store.db.run(create)
    return NewWebhookOut(**WebhookOut.of(view).model_dump(exclude={"object"}), secret=secret)


@router.get("/webhooks/deliveries", response_model=DeliveryList)
async def list_deliveries(
    tenancy: TenancyDep,
    webhook_id: str | None = Query(None, description="one subscription's only"),
    limit: int = Query(50, ge=1, le=MAX_DELIVERIES),
    caller: Caller = operator,
) -> DeliveryList:
    number = webhook_number(webhook_id) if webhook_id is not None else None
    views = await tenancy.store.db.run(
        lambda s: store.deliveries(s, webhook_id=number, limit=limit)
    )
    return DeliveryList(data=[DeliveryOut.of(v, viewer=_viewer(caller)) for v in views])


@router.get("/webhooks/{webhook_id}", response_model=WebhookOut)
async def get_webhook(
    tenancy: TenancyDep, webhook_id: str, caller: Caller = operator
) -> WebhookOut:
    number = webhook_number(webhook_id)
    row = await tenancy.store.db.run(
        lambda s: store.WebhookView.of(store.require_webhook(s, number))
    )
    return WebhookOut.of(row, viewer=_viewer(caller))


@router.delete("/webhooks/{webhook_id}", response_model=Deleted)
async def delete_webhook(
    tenancy: TenancyDep, webhook_id: str, caller: Caller = operator
) -> Deleted:
    number = webhook_number(webhook_id)
    await tenancy.store.db.run(lambda s: store.delete_webhook(s, caller.id, number))
    return Deleted(id=str(number))


@router.post("/webhooks/{webhook_id}/test", response_model=TestQueued, status_code=202)
async def test_webhook(
    webhooks: WebhooksDep, webhook_id: str, caller: Caller = operator
) -> TestQueued:
    """Queue a ``webhook.test`` delivery to this subscription (whatever its events); its
    outcome is listed under /admin/api/webhooks/deliveries within seconds."""
    number = webhook_number(webhook_id)
    event_id = await webhooks.test_send(number)
    return TestQueued(webhook_id=str(number), event_id=event_id)
