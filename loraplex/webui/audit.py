"""The Audit log page: every change, newest first, filtered by tenant, action (exact, or a prefix
such as ``key.``), actor and UTC days, a page at a time ("Older" follows the last event's id:
keyset pagination, as fast on the millionth event as on the first). Each event shows what it
changed as a compact diff of its before/after snapshots.

Route::

    GET /admin/audit   ?tenant=&action=&actor=&since=YYYY-MM-DD&until=YYYY-MM-DD&before=<id>
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session
from starlette.responses import Response

from loraplex.platform import audit
from loraplex.platform.db.models import AuditEvent, utcnow
from loraplex.webui.context import NavItem, SignedIn, render, webui_of
from loraplex.webui.views import (
    QUOTA_LABELS,
    FormErrors,
    fmt_ago,
    fmt_iso,
    fmt_time,
    fmt_value,
    whole_number,
)

NAV = NavItem("Audit log", "/admin/audit")
PAGE_SIZE = 50
FILTERS = ("tenant", "action", "actor", "since", "until")
MAX_BEFORE_ID = 10**11 - 1  # ?before= (an event id)
# Suggestions for the action filter (any action or prefix works).
ACTIONS = (
    "tenant.", "tenant.create", "tenant.update", "tenant.suspend", "tenant.resume",
    "tenant.delete", "key.", "key.create", "key.revoke", "adapter.",
)  # fmt: skip

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True)
class Change:
    """One field of an event: ``old`` → ``new`` (``old`` None: set; ``new`` None: removed)."""

    field: str
    old: str | None
    new: str | None


def _show(field: str, value: Any) -> str:
    if value is None and field in QUOTA_LABELS:
        return "no limit"
    return fmt_value(value)


def changes(
    before: dict[str, Any] | None, after: dict[str, Any] | None, object_id: str = ""
) -> list[Change]:
    """What an event changed: the differing fields of an update; the non-empty fields of a
    creation (``before`` None) or a deletion (``after`` None), less those that only repeat the
    event's ``object_id``."""
    if before is not None and after is not None:
        fields = list(dict.fromkeys([*before, *after]))
        return [
            Change(f, _show(f, before.get(f)), _show(f, after.get(f)))
            for f in fields
            if before.get(f) != after.get(f)
        ]
    snapshot = after if after is not None else before
    if not snapshot:
        return []
    shown = [(f, v) for f, v in snapshot.items() if v not in (None, "", [], object_id)]
    if after is not None:
        return [Change(f, None, _show(f, v)) for f, v in shown]
    return [Change(f, _show(f, v), None) for f, v in shown]


def _row(event: AuditEvent, now: dt.datetime) -> dict[str, Any]:
    return {
        "id": event.id,
        "when": fmt_time(event.created_at),
        "iso": fmt_iso(event.created_at),
        "ago": fmt_ago(event.created_at, now),
        "actor": event.actor,
        "action": event.action,
        "tenant": event.tenant_name or "",
        "object": f"{event.object_type} {event.object_id}",
        "changes": changes(event.before, event.after, event.object_id),
        "ip": event.ip or "",
    }


def _day(text: str, field: str, errors: FormErrors) -> dt.date | None:
    if not text:
        return None
    first, last = audit.FIRST_TIME.date(), audit.LAST_TIME.date()  # ``until`` adds a day
    try:
        if len(text) != 10:
            raise ValueError(text)
        day = dt.date.fromisoformat(text)
        if not first <= day <= last:
            raise ValueError(text)
    except ValueError:
        errors[field] = (
            f"Enter a date as YYYY-MM-DD (UTC) from {first} to {last}, for example 2025-01-31."
        )
        return None
    return day


def _midnight(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time(), tzinfo=dt.timezone.utc)


def parse_filters(values: dict[str, str], errors: FormErrors) -> audit.AuditFilter:
    """The filter of the page's query; ``until`` includes its whole day; ``key.*`` = ``key.``."""
    since = _day(values["since"], "since", errors)
    until = _day(values["until"], "until", errors)
    if since and until and since > until:
        errors["until"] = "The last day is before the first; swap them."
    action = values["action"]
    if action.endswith(".*"):
        action = action[:-1]
    return audit.AuditFilter(
        tenant_name=values["tenant"] or None,
        action=action or None,
        actor=values["actor"] or None,
        since=_midnight(since) if since else None,
        until=_midnight(until + dt.timedelta(days=1)) if until else None,
    )


@router.get("/admin/audit")
async def audit_log(request: Request, admin: SignedIn) -> Response:
    params = request.query_params
    values = {name: params.get(name, "").strip()[:200] for name in FILTERS}
    errors = FormErrors()
    filters = parse_filters(values, errors)
    before_text = params.get("before", "")
    before_id = None
    if before_text:
        before_id = whole_number(before_text, len(str(MAX_BEFORE_ID)))
        if before_id is None or not 1 <= before_id <= MAX_BEFORE_ID:
            before_id = None
            errors["_"] = (
                f"That page link is broken (before= takes an event id from 1 to "
                f"{MAX_BEFORE_ID:,}); showing the newest events instead."
            )
    now = utcnow()
    rows: list[dict[str, Any]] = []
    older = None
    if not (errors.keys() - {"_"}):

        def read(session: Session) -> tuple[list[dict[str, Any]], int | None]:
            found = audit.events(session, filters, limit=PAGE_SIZE + 1, before_id=before_id)
            more = len(found) > PAGE_SIZE
            found = found[:PAGE_SIZE]
            return [_row(e, now) for e in found], found[-1].id if more else None

        rows, older = await webui_of(request).store.db.run(read)
    kept = [(k, v) for k, v in values.items() if v]
    return render(
        request,
        "audit.html",
        admin=admin,
        status=400 if errors else 200,
        title="Audit log",
        rows=rows,
        values=values,
        errors=errors,
        actions=ACTIONS,
        filtered=bool(kept),
        paged=before_id is not None,
        older_query=urlencode([*kept, ("before", str(older))]) if older is not None else None,
        newest_query=urlencode(kept),
    )
