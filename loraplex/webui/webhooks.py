"""The Webhooks page: the operator's alert subscriptions (URL, events; never the secret, which
is shown once, right after creation), a form to add one, delete and test-send buttons, and the
recent deliveries with their outcome (state, attempts, the receiver's status, the last error).

Changes go through ``loraplex.platform.webhooks.store`` with the actor ``admin (web)``, each with
its audit event; a test-send queues a ``webhook.test`` event for the background worker.

Routes::

    GET  /admin/webhooks                   POST (same path: add one)
    POST /admin/webhooks/{webhook_id}/delete
    POST /admin/webhooks/{webhook_id}/test
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session
from starlette.responses import Response

from loraplex.platform.errors import APIError
from loraplex.platform.webhooks import store
from loraplex.platform.webhooks.redact import viewer_error, viewer_url
from loraplex.webui.context import FormPost, NavItem, SignedIn, redirect, render, webui_of
from loraplex.webui.views import WEB_ACTOR, FormErrors, fmt_time, whole_number

NAV = NavItem("Webhooks", "/admin/webhooks")
PAGE = "/admin/webhooks"
RECENT = 50

router = APIRouter(include_in_schema=False)


def _secret_slot(webhook_id: int) -> str:
    return f"webhook:{webhook_id}"  # key public ids have no ':'


def _delivery_row(d: store.DeliveryView, viewer: bool) -> dict[str, Any]:
    status = str(d.last_status) if d.last_status is not None else "—"
    error = viewer_error(d.last_error) if viewer else d.last_error
    return {
        "id": d.id,
        "webhook_id": d.webhook_id,
        "event": d.kind,
        "event_id": d.event_id,
        "state": d.state,
        "attempts": d.attempts,
        "status": status,
        "error": error or "",
        "duration": f"{d.last_duration_ms:,.0f} ms" if d.last_duration_ms is not None else "—",
        "created": fmt_time(d.created_at),
        "next": fmt_time(d.next_attempt_at) if d.next_attempt_at else "",
    }


async def _page(
    request: Request,
    admin: Any,
    *,
    values: dict[str, Any] | None = None,
    errors: FormErrors | None = None,
    status: int = 200,
) -> Response:
    def read(session: Session) -> tuple[list[store.WebhookView], list[store.DeliveryView]]:
        return store.list_webhooks(session), store.deliveries(session, limit=RECENT)

    hooks, recent = await webui_of(request).store.db.run(read)
    viewer = bool(admin.session.read_only)  # receivers' origins only (webhooks/redact.py)
    created = whole_number(request.query_params.get("created", ""), 12)
    secret = None
    if created is not None:
        secret = webui_of(request).new_keys.take(admin.session, _secret_slot(created))
    return render(
        request,
        "webhooks.html",
        admin=admin,
        status=status,
        title="Webhooks",
        hooks=[
            {
                "id": h.id,
                "url": viewer_url(h.url) if viewer else h.url,
                "events": ", ".join(h.events),
                "description": h.description,
                "created": fmt_time(h.created_at),
            }
            for h in hooks
        ],
        deliveries=[_delivery_row(d, viewer) for d in recent],
        event_types=[(n, f"{n}: {meaning}") for n, meaning in store.EVENT_TYPES.items()],
        created_id=created,
        secret=secret,
        values=values or {"url": "", "events": [], "description": ""},
        errors=errors or FormErrors(),
    )


@router.get(PAGE)
async def webhooks_page(request: Request, admin: SignedIn) -> Response:
    return await _page(request, admin)


@router.post(PAGE)
async def add_webhook(request: Request, admin: FormPost) -> Response:
    assert admin.form is not None
    events = [e for e in admin.form.getlist("events") if isinstance(e, str)]
    url, description = admin.field("url").strip(), admin.field("description").strip()
    values: dict[str, Any] = {"url": url, "events": events, "description": description}
    errors = FormErrors()
    if not events:
        errors["events"] = "Tick at least one event: a webhook without events receives nothing."
    if not errors:
        try:
            view, secret = await webui_of(request).store.db.run(
                lambda s: store.create_webhook(s, WEB_ACTOR, url, events, description)
            )
        except APIError as error:
            errors.add_api_error(error)
    if errors:
        return await _page(request, admin, values=values, errors=errors, status=400)
    webui_of(request).new_keys.put(admin.session, _secret_slot(view.id), secret)
    admin.flash("success", "Webhook added: copy its signing secret now.")
    return redirect(request, f"{PAGE}?created={view.id}")


@router.post(PAGE + "/{webhook_id}/delete")
async def remove_webhook(request: Request, webhook_id: int, admin: FormPost) -> Response:
    try:
        await webui_of(request).store.db.run(
            lambda s: store.delete_webhook(s, WEB_ACTOR, webhook_id)
        )
    except APIError as error:
        admin.flash("error", error.message)
    else:
        admin.flash("success", "Webhook removed, with its deliveries.")
    return redirect(request, PAGE)


@router.post(PAGE + "/{webhook_id}/test")
async def test_webhook(request: Request, webhook_id: int, admin: FormPost) -> Response:
    try:
        event_id = await webui_of(request).tenancy.webhooks.test_send(webhook_id)
    except APIError as error:
        admin.flash("error", error.message)
    else:
        admin.flash("success", f"Test event {event_id} queued: its delivery is listed below.")
    return redirect(request, PAGE)
