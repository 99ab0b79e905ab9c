"""The request log's reads: filters, pages by cursor, one request by id, CSV rows, the
retention purge and the tenants' opt-in to bodies (rows: ``db.models.RequestLogEntry``, written
by ``request_log_writer.RequestLogWriter``).

Pages are newest first by ``id`` (keyset pagination): a page's ``next_cursor`` is the id of its
last row and the next page holds the rows with smaller ids. Rows are inserted with growing ids,
so rows written while an operator pages never appear twice or push another row off a page.
Every filter value is bounded and checked here (400 naming the parameter and how to fix it),
for the admin API and the admin UI alike.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, delete, select
from sqlalchemy.orm import Session

from loraplex.platform import audit, tenants
from loraplex.platform.audit import parse_time
from loraplex.platform.db.models import RequestLogEntry, RequestLogSetting, Tenant, utcnow
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.errors import NOT_FOUND, APIError

MAX_PAGE = 500
DEFAULT_PAGE = 100
MAX_CURSOR = 2**63 - 1
MAX_CSV_ROWS = 100_000  # one export; narrow the filters (time range) for more
CSV_BATCH = 1000  # rows per database read while an export streams
MAX_BODY_BYTES = 1024 * 1024  # request_log.MAX_BODY_CAPTURE: a tenant's cap is at most this
DEFAULT_BODY_BYTES = 4096
PURGE_BATCH = 5000  # rows per delete: short transactions beside the request writes

STATUS_CLASSES = {"2xx": (200, 300), "3xx": (300, 400), "4xx": (400, 500), "5xx": (500, 600)}
_TENANT = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
_KEY = re.compile(r"[A-Za-z0-9]{1,32}")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")  # request ids and model names: visible ASCII
CSV_COLUMNS = (
    "created_at", "request_id", "tenant", "key", "method", "endpoint", "model", "served_model",
    "status", "error_code", "prompt_tokens", "completion_tokens", "ttft_ms", "duration_ms",
    "finish_reason", "stream",
)  # fmt: skip


def _bad(param: str, message: str, code: str = "invalid_filter") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class RequestFilter:
    """What a search keeps; None: any."""

    tenant: str | None = None  # a tenant's name
    key: str | None = None  # a key's public id
    model: str | None = None  # as sent, or as served ("name@N", the base model's name)
    status: tuple[int, int] | None = None  # [low, high)
    since: dt.datetime | None = None
    until: dt.datetime | None = None  # exclusive
    request_id: str | None = None

    @property
    def empty(self) -> bool:
        return self == RequestFilter()


def parse_filter(
    *,
    tenant: str | None = None,
    key: str | None = None,
    model: str | None = None,
    status: str | None = None,
    since: str | None = None,
    until: str | None = None,
    request_id: str | None = None,
) -> RequestFilter:
    """A ``RequestFilter`` from query values (empty strings: no filter); 400 on a bad one."""
    tenant, key, model, status = (v.strip() if v else None for v in (tenant, key, model, status))
    request_id = request_id.strip() if request_id else None
    if tenant and not _TENANT.fullmatch(tenant):
        raise _bad("tenant", f"tenant must be a tenant's name (lowercase letters, digits and "
                   f"'-', at most 64); got {tenant[:40]!r}.")  # fmt: skip
    if key and not _KEY.fullmatch(key):
        raise _bad("key", f"key must be a key's public id (letters and digits, at most 32, "
                   f"as in lpx_<public id>_...); got {key[:40]!r}.")  # fmt: skip
    if model and (len(model) > 140 or not _PRINTABLE.fullmatch(model)):
        raise _bad("model", f"model must be a model's name (at most 140 visible characters, "
                   f"such as 'pirate@2'); got {model[:40]!r}.")  # fmt: skip
    if request_id and (len(request_id) > 64 or not _PRINTABLE.fullmatch(request_id)):
        raise _bad("request_id", f"request_id must be a request's id (at most 64 visible "
                   f"characters, as in x-request-id); got {request_id[:40]!r}.")  # fmt: skip
    bounds = None
    if status:
        bounds = STATUS_CLASSES.get(status.lower())
        if bounds is None and status.isdigit() and len(status) == 3 and 100 <= int(status) < 600:
            bounds = (int(status), int(status) + 1)
        if bounds is None:
            raise _bad("status", f"status must be a class ({', '.join(STATUS_CLASSES)}) or a "
                       f"status code from 100 to 599; got {status[:20]!r}.")  # fmt: skip
    start, end = parse_time(since, "since"), parse_time(until, "until")
    if start is not None and end is not None and end <= start:
        raise _bad("until", "until must be after since (since includes, until excludes); "
                   "swap them.", "invalid_time")  # fmt: skip
    return RequestFilter(
        tenant=tenant or None, key=key or None, model=model or None, status=bounds,
        since=start, until=end, request_id=request_id or None,
    )  # fmt: skip


def parse_cursor(cursor: str | None) -> int | None:
    """The row id a ``next_cursor`` names; 400 when it is not one."""
    if cursor is None or cursor == "":
        return None
    value = cursor.strip()
    if not (value.isdigit() and len(value) <= 19 and 1 <= int(value) <= MAX_CURSOR):
        raise _bad("cursor", "cursor must be the next_cursor of the previous page (a number); "
                   "leave it out for the newest page.", "invalid_cursor")  # fmt: skip
    return int(value)


def check_limit(limit: int, maximum: int = MAX_PAGE, param: str = "limit") -> int:
    if not 1 <= limit <= maximum:
        raise _bad(param, f"{param} must be from 1 to {maximum:,}; got {limit}.", "invalid_limit")
    return limit


def _query(session: Session, filters: RequestFilter) -> Select[Any]:
    """Rows and their tenant's name, filtered; the tenant filter through its ``TenantScope``.
    404 for a tenant that does not exist (an empty page would hide a typo)."""
    query: Select[Any]
    if filters.tenant is not None:
        tenant = tenants.require_tenant(session, filters.tenant)
        query = TenantScope(session, tenant.id).select(RequestLogEntry)
    else:
        query = select(RequestLogEntry)
    query = query.add_columns(Tenant.name).outerjoin(Tenant, Tenant.id == RequestLogEntry.tenant_id)
    entry = RequestLogEntry
    if filters.key is not None:
        query = query.where(entry.key_id == filters.key)
    if filters.model is not None:
        query = query.where((entry.served_model == filters.model) | (entry.model == filters.model))
    if filters.status is not None:
        query = query.where(entry.status >= filters.status[0], entry.status < filters.status[1])
    if filters.since is not None:
        query = query.where(entry.created_at >= filters.since)
    if filters.until is not None:
        query = query.where(entry.created_at < filters.until)
    if filters.request_id is not None:
        query = query.where(entry.request_id == filters.request_id)
    return query


def rows(
    session: Session, filters: RequestFilter, *, limit: int, before_id: int | None = None
) -> list[tuple[RequestLogEntry, str | None]]:
    """Up to ``limit`` rows (with their tenant's name), newest first, older than ``before_id``."""
    query = _query(session, filters)
    if before_id is not None:
        query = query.where(RequestLogEntry.id < before_id)
    found = session.execute(query.order_by(RequestLogEntry.id.desc()).limit(limit)).tuples()
    return [(e, name) for e, name in found]


def entry_view(entry: RequestLogEntry, tenant: str | None, *, bodies: bool) -> dict[str, Any]:
    """The JSON of one row; ``bodies``: with the stored bodies (null where none were kept)."""
    view: dict[str, Any] = {
        "object": "request_log_entry",
        "id": entry.id,
        "request_id": entry.request_id,
        "created_at": entry.created_at.isoformat(),
        "tenant": tenant,
        "key": entry.key_id,
        "method": entry.method,
        "endpoint": entry.endpoint,
        "model": entry.model,
        "served_model": entry.served_model,
        "status": entry.status,
        "error_code": entry.error_code,
        "prompt_tokens": entry.prompt_tokens,
        "completion_tokens": entry.completion_tokens,
        "ttft_ms": entry.ttft_ms,
        "duration_ms": entry.duration_ms,
        "finish_reason": entry.finish_reason,
        "stream": entry.stream,
        "has_bodies": entry.request_body is not None or entry.response_body is not None,
    }
    if bodies:
        view["request_body"] = entry.request_body
        view["response_body"] = entry.response_body
    return view


def page(
    session: Session, filters: RequestFilter, *, limit: int, before_id: int | None
) -> dict[str, Any]:
    """One page: ``{"data", "has_more", "next_cursor"}`` (pass ``next_cursor`` as ``cursor``)."""
    found = rows(session, filters, limit=limit + 1, before_id=before_id)
    more = len(found) > limit
    found = found[:limit]
    return {
        "object": "list",
        "data": [entry_view(e, name, bodies=False) for e, name in found],
        "has_more": more,
        "next_cursor": str(found[-1][0].id) if more and found else None,
    }


def by_request_id(session: Session, request_id: str) -> dict[str, Any]:
    """The newest row with ``request_id``, with its bodies; 404 when there is none."""
    filters = parse_filter(request_id=request_id)
    found = rows(session, filters, limit=1)
    if not found:
        raise APIError(
            404,
            f"No request {request_id[:64]!r} in the request log: check the id (the x-request-id "
            "of the response, or the id in its body); rows older than the retention are gone.",
            type=NOT_FOUND,
            param="request_id",
            code="request_not_found",
        )
    entry, name = found[0]
    return entry_view(entry, name, bodies=True)


# ---- CSV ---------------------------------------------------------------------------------------


def _cell(value: Any) -> Any:
    """A cell a spreadsheet will not run as a formula (model names come from callers)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def csv_line(values: list[Any]) -> str:
    out = io.StringIO()
    csv.writer(out).writerow([_cell(v) for v in values])
    return out.getvalue()


def csv_header() -> str:
    return csv_line(list(CSV_COLUMNS))


def csv_batch(
    session: Session, filters: RequestFilter, *, limit: int, before_id: int | None
) -> tuple[str, int | None, int]:
    """The CSV lines of up to ``limit`` rows older than ``before_id``, the id to continue
    before (None: no more), and how many rows."""
    found = rows(session, filters, limit=limit, before_id=before_id)
    lines = []
    for e, name in found:
        view = entry_view(e, name, bodies=False)
        lines.append(csv_line([view[c] if c != "tenant" else name for c in CSV_COLUMNS]))
    last = found[-1][0].id if len(found) == limit else None
    return "".join(lines), last, len(found)


def csv_plan(total: int) -> Iterator[int]:
    """Batch sizes of an export of at most ``total`` rows."""
    while total > 0:
        yield min(CSV_BATCH, total)
        total -= CSV_BATCH


# ---- retention ---------------------------------------------------------------------------------


def purge(session: Session, retention_days: int, now: dt.datetime | None = None) -> int:
    """Delete up to ``PURGE_BATCH`` rows that arrived more than ``retention_days`` ago; returns
    how many went (call again while it returns ``PURGE_BATCH``)."""
    cutoff = (now or utcnow()) - dt.timedelta(days=retention_days)
    old = select(RequestLogEntry.id).where(RequestLogEntry.created_at < cutoff)
    ids = list(session.scalars(old.order_by(RequestLogEntry.id).limit(PURGE_BATCH)))
    if ids:
        session.execute(delete(RequestLogEntry).where(RequestLogEntry.id.in_(ids)))
    return len(ids)


# ---- bodies: a tenant's opt-in -----------------------------------------------------------------


def body_caps(session: Session) -> dict[int, int]:
    """Every opted-in tenant's cap (bytes of each body)."""
    found = session.execute(select(RequestLogSetting.tenant_id, RequestLogSetting.body_max_bytes))
    return {tid: cap for tid, cap in found.tuples()}


def settings_view(tenant: Tenant, cap: int | None) -> dict[str, Any]:
    return {
        "object": "request_log_settings",
        "tenant": tenant.name,
        "log_bodies": cap is not None,
        "body_max_bytes": cap,
    }


def get_settings(session: Session, tenant_name: str) -> dict[str, Any]:
    tenant = tenants.require_tenant(session, tenant_name)
    setting = session.get(RequestLogSetting, tenant.id)
    return settings_view(tenant, setting.body_max_bytes if setting is not None else None)


def set_settings(
    session: Session, actor: str, tenant_name: str, *, log_bodies: bool, body_max_bytes: int
) -> tuple[int, int | None, dict[str, Any]]:
    """Turn a tenant's bodies on (cut at ``body_max_bytes`` each) or off, with its audit
    event; returns the tenant's id, its cap now and the view."""
    check_limit(body_max_bytes, MAX_BODY_BYTES, "body_max_bytes")
    tenant = tenants.require_tenant(session, tenant_name)
    setting = session.get(RequestLogSetting, tenant.id)
    before = setting.body_max_bytes if setting is not None else None
    if log_bodies:
        if setting is None:
            setting = RequestLogSetting(tenant_id=tenant.id, body_max_bytes=body_max_bytes)
            session.add(setting)
        setting.body_max_bytes = body_max_bytes
        cap: int | None = body_max_bytes
    else:
        if setting is not None:
            session.delete(setting)
        cap = None
    audit.record(
        session, actor, "tenant.request_log", "tenant", tenant.name, tenant_name=tenant.name,
        before={"body_max_bytes": before}, after={"body_max_bytes": cap},
    )  # fmt: skip
    return tenant.id, cap, settings_view(tenant, cap)
