"""The request log over HTTP (audience "operator", ``/admin/api``)::

    GET    /requests                        filters, newest first, a page by cursor
    GET    /requests.csv                    the same filters as CSV, streamed (at most 100,000)
    GET    /requests/{request_id}           one request, with its bodies where they were kept
    GET    /tenants/{tenant}/request-log    a tenant's opt-in to bodies
    PUT    /tenants/{tenant}/request-log    {"log_bodies": true, "body_max_bytes": 4096}

Filters (each optional, each checked: a 400 names the bad one): ``tenant`` (name), ``key``
(public id), ``model`` (as sent or as served: ``pirate@2``), ``status`` (``2xx``, ``4xx``,
``5xx`` or a code), ``since`` / ``until`` (ISO 8601, UTC without a zone; ``until`` excluded),
``request_id``. Reads write this replica's queued rows first (read your own writes).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import Field, StrictBool, StrictInt
from sqlalchemy.orm import Session
from starlette.responses import StreamingResponse

from loraplex.platform import request_logs
from loraplex.platform.access import operator_caller
from loraplex.platform.api.bodies import StrictBody
from loraplex.platform.auth import SCOPE_ADMIN, Caller
from loraplex.platform.deps import TenancyDep
from loraplex.platform.request_log_writer import RequestLogWriter

operator_router = APIRouter(prefix="/admin/api", tags=["admin"])
operator = Depends(operator_caller)


def _writer(tenancy: TenancyDep) -> RequestLogWriter:
    return tenancy.request_log


WriterDep = Annotated[RequestLogWriter, Depends(_writer)]


def _filters(
    tenant: str | None = Query(None, max_length=200, description="a tenant's name"),
    key: str | None = Query(None, max_length=200, description="a key's public id"),
    model: str | None = Query(None, max_length=200, description="as sent, or 'name@N'"),
    status: str | None = Query(None, max_length=20, description="2xx | 3xx | 4xx | 5xx | a code"),
    since: str | None = Query(None, max_length=64, description="ISO 8601 (UTC if no zone)"),
    until: str | None = Query(None, max_length=64, description="exclusive"),
    request_id: str | None = Query(None, max_length=200),
) -> request_logs.RequestFilter:
    return request_logs.parse_filter(
        tenant=tenant, key=key, model=model, status=status, since=since, until=until,
        request_id=request_id,
    )  # fmt: skip


FilterDep = Annotated[request_logs.RequestFilter, Depends(_filters)]


class RequestLogSettingsBody(StrictBody):
    """A tenant's opt-in to bodies in its request log (off: none are stored)."""

    log_bodies: StrictBool = Field(description="store the request and response bodies")
    body_max_bytes: StrictInt = Field(
        request_logs.DEFAULT_BODY_BYTES,
        description=f"bytes kept of each body (1 to {request_logs.MAX_BODY_BYTES:,}); the rest "
        "is cut off",
    )


@operator_router.get("/requests")
async def list_requests(
    writer: WriterDep,
    filters: FilterDep,
    cursor: str | None = Query(None, max_length=40, description="next_cursor of the last page"),
    limit: int = Query(request_logs.DEFAULT_PAGE, description="rows per page, 1 to 500"),
    caller: Caller = operator,
) -> dict[str, Any]:
    """The request log, newest first, a page at a time (keyset: stable while rows arrive)."""
    request_logs.check_limit(limit)
    before_id = request_logs.parse_cursor(cursor)
    await writer.flush()
    read = partial(request_logs.page, filters=filters, limit=limit, before_id=before_id)
    result: dict[str, Any] = await writer.db.run(read)
    return result


@operator_router.get("/requests.csv")
async def export_requests(
    writer: WriterDep,
    filters: FilterDep,
    limit: int = Query(request_logs.MAX_CSV_ROWS, description="at most this many rows"),
    caller: Caller = operator,
) -> StreamingResponse:
    """The filtered request log as CSV (no bodies), newest first, read and sent in batches."""
    request_logs.check_limit(limit, request_logs.MAX_CSV_ROWS)
    await writer.flush()
    # The first batch is read before the response starts: a 404 (unknown tenant) is still JSON.
    plan = request_logs.csv_plan(limit)
    size = next(plan)
    read = partial(request_logs.csv_batch, filters=filters, limit=size, before_id=None)
    first, after, _ = await writer.db.run(read)

    async def lines() -> AsyncIterator[str]:
        yield request_logs.csv_header()
        yield first
        before = after
        for size in plan:
            if before is None:
                return
            text, before, _ = await writer.db.run(
                partial(request_logs.csv_batch, filters=filters, limit=size, before_id=before)
            )
            yield text

    return StreamingResponse(
        lines(),
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": 'attachment; filename="requests.csv"'},
    )


@operator_router.get("/requests/{request_id}")
async def get_request(writer: WriterDep, request_id: str, caller: Caller = operator) -> Any:
    """One request by its id (``x-request-id``), with its bodies where they were kept (for an
    operator; a viewer's session gets ``null`` bodies: they are the tenant's content)."""
    await writer.flush()
    view = await writer.db.run(partial(request_logs.by_request_id, request_id=request_id))
    if not caller.has_scope(SCOPE_ADMIN):
        view["request_body"] = view["response_body"] = None
    return view


@operator_router.get("/tenants/{tenant}/request-log")
async def get_request_log_settings(
    writer: WriterDep, tenant: str, caller: Caller = operator
) -> Any:
    """Whether the tenant's request bodies are stored, and how much of each."""
    return await writer.db.run(partial(request_logs.get_settings, tenant_name=tenant))


@operator_router.put("/tenants/{tenant}/request-log")
async def put_request_log_settings(
    writer: WriterDep, tenant: str, body: RequestLogSettingsBody, caller: Caller = operator
) -> Any:
    """Turn the tenant's bodies on (each cut at ``body_max_bytes``) or off; in effect on this
    replica's next request, on the others' within ``request_log_writer.CAPS_REFRESH_S``."""

    def change(session: Session) -> tuple[int, int | None, dict[str, Any]]:
        return request_logs.set_settings(
            session, caller.id, tenant, log_bodies=body.log_bodies,
            body_max_bytes=body.body_max_bytes,
        )  # fmt: skip

    tenant_id, cap, view = await writer.db.run(change)
    writer.set_cap(tenant_id, cap)
    return view
