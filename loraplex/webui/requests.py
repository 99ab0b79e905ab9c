"""The Requests page: the stored request log (``loraplex.platform.request_logs``), newest
first, filtered by tenant, key, model, status class, time range and request id, a page at a
time ("Older" follows the last row's id: keyset pagination), with the same rows as CSV and one
request's page (its bodies where its tenant opted in).

Routes::

    GET /admin/requests        ?tenant=&key=&model=&status=&since=&until=&request_id=&cursor=
    GET /admin/requests.csv    the filtered rows (at most 100,000, no bodies), streamed
    GET /admin/requests/{id}   one request

A filter the log refuses is shown beside its field (the API's message), never as JSON.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from loraplex.platform import request_logs
from loraplex.platform.errors import APIError
from loraplex.webui.context import NavItem, Refused, SignedIn, render, secure_headers, webui_of
from loraplex.webui.views import FormErrors

NAV = NavItem("Requests", "/admin/requests")
PATH = "/admin/requests"
CSV_PATH = "/admin/requests.csv"
PAGE_SIZE = 50
FILTERS = ("tenant", "key", "model", "status", "since", "until", "request_id")
STATUS_CHOICES = (("", "Any"), ("2xx", "2xx"), ("4xx", "4xx"), ("5xx", "5xx"))

router = APIRouter(include_in_schema=False)


def _filters(values: dict[str, str], errors: FormErrors) -> request_logs.RequestFilter | None:
    """The filter of the page's query; each bad field's message goes beside that field."""
    for name, value in values.items():  # one at a time: every bad field gets its message
        try:
            request_logs.parse_filter(**{name: value})
        except APIError as exc:
            errors.add_api_error(exc, name)
    if errors:
        return None
    try:
        return request_logs.parse_filter(**values)
    except APIError as exc:  # fields fine alone, not together (until before since)
        errors.add_api_error(exc)
        return None


def _row(view: dict[str, Any]) -> dict[str, Any]:
    status = view["status"]
    tone = "ok" if status < 400 else ("warn" if status < 500 or status == 499 else "danger")
    ttft = view["ttft_ms"]
    return view | {
        "when": view["created_at"][:19].replace("T", " "),
        "tone": tone,
        "tokens": f"{view['prompt_tokens']} / {view['completion_tokens']}",
        "ttft": "—" if ttft is None else f"{ttft:.0f} ms",
        "duration": f"{view['duration_ms']:.0f} ms",
        "shown_model": view["served_model"] or view["model"] or "—",
    }


@router.get(PATH)
async def requests_page(request: Request, admin: SignedIn) -> Response:
    params = request.query_params
    values = {name: params.get(name, "").strip()[:200] for name in FILTERS}
    errors = FormErrors()
    filters = _filters(values, errors)
    before_id = None
    try:
        before_id = request_logs.parse_cursor(params.get("cursor", "")[:40])
    except APIError:
        errors["_"] = "That page link is broken; showing the newest requests instead."
    rows: list[dict[str, Any]] = []
    older = None
    if filters is not None:
        writer = webui_of(request).tenancy.request_log
        await writer.flush()  # read your own writes
        read = partial(request_logs.page, filters=filters, limit=PAGE_SIZE, before_id=before_id)
        try:
            page = await writer.db.run(read)
        except APIError as exc:  # a tenant that does not exist
            errors[exc.param or "tenant"] = exc.message
        else:
            rows, older = [_row(v) for v in page["data"]], page["next_cursor"]
    kept = [(k, v) for k, v in values.items() if v]
    return render(
        request,
        "requests.html",
        admin=admin,
        status=400 if errors.keys() - {"_"} else 200,
        title="Requests",
        rows=rows,
        values=values,
        errors=errors,
        statuses=STATUS_CHOICES,
        filtered=bool(kept),
        paged=before_id is not None,
        older_query=urlencode([*kept, ("cursor", older)]) if older is not None else None,
        newest_query=urlencode(kept),
        csv_query=urlencode(kept),
    )


@router.get(CSV_PATH)
async def requests_csv(request: Request, admin: SignedIn) -> Response:
    params = request.query_params
    values = {name: params.get(name, "").strip()[:200] for name in FILTERS}
    errors = FormErrors()
    filters = _filters(values, errors)
    if filters is None:
        return await requests_page(request, admin)
    writer = webui_of(request).tenancy.request_log
    await writer.flush()
    plan = request_logs.csv_plan(request_logs.MAX_CSV_ROWS)
    read = partial(request_logs.csv_batch, filters=filters, limit=next(plan), before_id=None)
    try:
        first, after, _ = await writer.db.run(read)
    except APIError:
        return await requests_page(request, admin)

    async def lines() -> AsyncIterator[str]:
        yield request_logs.csv_header()
        yield first
        before = after
        for size in plan:
            if before is None:
                return
            batch = partial(request_logs.csv_batch, filters=filters, limit=size, before_id=before)
            text, before, _ = await writer.db.run(batch)
            yield text

    response = StreamingResponse(
        lines(),
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": 'attachment; filename="requests.csv"'},
    )
    return secure_headers(response)


@router.get(PATH + "/{request_id}")
async def request_page(request: Request, request_id: str, admin: SignedIn) -> Response:
    writer = webui_of(request).tenancy.request_log
    await writer.flush()
    try:
        view = await writer.db.run(partial(request_logs.by_request_id, request_id=request_id))
    except APIError as exc:
        raise Refused(
            404 if exc.status == 404 else 400,
            "Request not found",
            exc.message,
            action=("Search the request log", PATH),
        ) from None
    hidden = admin.session.read_only and view["has_bodies"]  # a viewer: the tenant's content
    if hidden:
        view["request_body"] = view["response_body"] = None
    return render(
        request, "requests_show.html", admin=admin, title=f"Request {view['request_id']}",
        row=_row(view), bodies_hidden=hidden,
    )  # fmt: skip
