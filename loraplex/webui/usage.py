"""The Usage page: requests and tokens per UTC day, tenant and model (adapter version), as two
server-drawn charts and a table, with the same rows as CSV.

Routes (the same filters on both: ``tenant``, ``model``, ``start``, ``end``)::

    GET /admin/usage        ?tenant=<name>&model=<model or adapter name>&start=&end=&page=<n>
    GET /admin/usage.csv    the filtered rows, oldest day first, as an attachment

The numbers come from ``loraplex.platform.usage``'s reports (raw rows plus daily roll-ups, the
same as ``GET /admin/api/usage``); this module only filters them by model and lays them out.
``model`` matches a model exactly, or every version of an adapter by its name (``support-bot``
matches ``support-bot@1`` and ``support-bot@2``). The operator's own requests (the playground's
among them) have no tenant: they show as "(operator)".

CSV cells that a spreadsheet would read as a formula (starting with ``= + - @``, a tab or a
carriage return) are prefixed with ``'``, so an adapter named ``-2+3`` stays text.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session
from starlette.responses import Response

from loraplex.platform import tenants as tenant_service
from loraplex.platform import usage as reports
from loraplex.platform.errors import APIError
from loraplex.webui.adapters import tenant_choices
from loraplex.webui.charts import Chart, line_chart
from loraplex.webui.context import NavItem, SignedIn, render, secure_headers, webui_of
from loraplex.webui.views import FormErrors, Pager, fmt_count, page_number

NAV = NavItem("Usage", "/admin/usage")
PATH = "/admin/usage"
CSV_PATH = "/admin/usage.csv"
PAGE_SIZE = 50
OPERATOR = "(operator)"  # rows without a tenant; parentheses never occur in a tenant's name
FILTERS = ("tenant", "model", "start", "end")
CSV_HEADER = (
    "date", "tenant", "model", "requests", "errors",
    "prompt_tokens", "completion_tokens", "total_tokens",
)  # fmt: skip
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True)
class Filters:
    tenant: str = ""
    model: str = ""
    start: str = ""
    end: str = ""

    @classmethod
    def of(cls, request: Request) -> Filters:
        params = request.query_params
        return cls(**{name: params.get(name, "").strip()[:80] for name in FILTERS})

    def query(self) -> list[tuple[str, str]]:
        return [(name, getattr(self, name)) for name in FILTERS]

    def matches_model(self, model: str) -> bool:
        return not self.model or model == self.model or model.split("@", 1)[0] == self.model


@dataclass(frozen=True)
class Usage:
    """The filtered report: buckets (tenant, day, model) oldest first, and their totals."""

    days: reports.DateRange
    buckets: list[reports.UsageBucket]
    totals: reports.UsageTotals


def _totals(buckets: Iterable[reports.UsageBucket]) -> reports.UsageTotals:
    totals = reports.UsageTotals()
    for b in buckets:
        totals.requests += b.requests
        totals.errors += b.errors
        totals.prompt_tokens += b.prompt_tokens
        totals.completion_tokens += b.completion_tokens
        totals.total_tokens += b.total_tokens
    return totals


async def load_usage(request: Request, filters: Filters) -> tuple[Usage | None, FormErrors]:
    """The report for ``filters``, or the problems with them (by field)."""
    errors = FormErrors()
    try:
        days = reports.parse_range(filters.start or None, filters.end or None)
    except APIError as exc:
        errors.add_api_error(exc, "start")
        return None, errors
    await webui_of(request).tenancy.usage.flush()  # read your own writes: buffered rows count

    def read(session: Session) -> reports.UsageReport | None:
        if not filters.tenant:
            return reports.all_usage(session, days)
        tenant = tenant_service.get_tenant(session, filters.tenant)
        if tenant is None:
            return None
        report = reports.tenant_usage(session, tenant.id, days)
        for bucket in report.data:
            bucket.tenant = tenant.name
        return report

    report = await webui_of(request).store.db.run(read)
    if report is None:
        errors["tenant"] = f"There is no tenant named {filters.tenant!r}."
        return None, errors
    buckets = [b for b in report.data if filters.matches_model(b.model)]
    for b in buckets:
        if b.tenant == "-":  # all_usage's mark for the operator's rows
            b.tenant = None
    return Usage(days, buckets, _totals(buckets)), errors


# ---- charts -----------------------------------------------------------------------------------


def compact(value: float) -> str:
    """``950``, ``12.5k``, ``3.2M``: a chart's axis label."""
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}" if value != int(value) else f"{int(value)}"


def day_labels(days: reports.DateRange) -> tuple[str, ...]:
    """Up to five evenly spaced day labels, first and last included."""
    n = (days.end - days.start).days + 1
    picks = range(n) if n <= 5 else sorted({round(k * (n - 1) / 4) for k in range(5)})
    return tuple(
        (days.start + dt.timedelta(days=i)).strftime("%b %d").replace(" 0", " ") for i in picks
    )


def charts(usage: Usage) -> list[Chart]:
    n = (usage.days.end - usage.days.start).days + 1
    per_day: dict[dt.date, list[int]] = {}
    for b in usage.buckets:
        acc = per_day.setdefault(b.date, [0, 0, 0, 0])
        for i, v in enumerate((b.requests, b.errors, b.prompt_tokens, b.completion_tokens)):
            acc[i] += v

    def series(i: int) -> list[float | None]:
        out: list[float | None] = []
        for k in range(n):
            day = usage.days.start + dt.timedelta(days=k)
            out.append(float(per_day.get(day, [0, 0, 0, 0])[i]))
        return out

    t = usage.totals
    span = f"{usage.days.start} to {usage.days.end} (UTC)"
    labels = day_labels(usage.days)
    tokens = line_chart(
        "Tokens per day",
        [("prompt", "series-a", series(2)), ("completion", "series-b", series(3))],
        fmt=compact,
        x_labels=labels,
        summary=(
            f"{span}: {t.prompt_tokens:,} prompt and {t.completion_tokens:,} completion tokens."
        ),
    )
    requests = line_chart(
        "Requests per day",
        [("requests", "series-a", series(0)), ("failed", "series-b", series(1))],
        fmt=compact,
        x_labels=labels,
        summary=f"{span}: {t.requests:,} requests, {t.errors:,} of them failed.",
    )
    if not t.requests:  # all zero: say "no data" rather than draw flat lines
        tokens = _empty(tokens)
        requests = _empty(requests)
    return [tokens, requests]


def _empty(chart: Chart) -> Chart:
    return replace(
        chart, empty=True, lines=tuple(replace(line, segments=()) for line in chart.lines)
    )


# ---- the page ---------------------------------------------------------------------------------


def _newest_first(b: reports.UsageBucket) -> tuple[int, str, str]:
    """Newest day first; within a day by tenant (the operator's last), then model."""
    return (-b.date.toordinal(), b.tenant or "~", b.model)


def _table_rows(buckets: list[reports.UsageBucket]) -> list[dict[str, Any]]:
    return [
        {
            "date": b.date.isoformat(),
            "tenant": b.tenant or OPERATOR,
            "is_operator": b.tenant is None,
            "model": b.model,
            "requests": fmt_count(b.requests),
            "errors": fmt_count(b.errors),
            "prompt_tokens": fmt_count(b.prompt_tokens),
            "completion_tokens": fmt_count(b.completion_tokens),
            "total_tokens": fmt_count(b.total_tokens),
        }
        for b in buckets
    ]


@router.get(PATH)
async def usage_page(request: Request, admin: SignedIn) -> Response:
    filters = Filters.of(request)
    usage, errors = await load_usage(request, filters)
    tenants = await webui_of(request).store.db.run(tenant_choices)
    rows: list[dict[str, Any]] = []
    pager = Pager(1, PAGE_SIZE, 0)
    if usage is not None:
        newest_first = sorted(usage.buckets, key=_newest_first)
        pager = Pager(
            page_number(request.query_params.get("page")), PAGE_SIZE, len(newest_first)
        ).clamped()
        rows = _table_rows(newest_first[pager.offset : pager.offset + pager.size])
    query = filters.query()
    return render(
        request,
        "usage.html",
        admin=admin,
        status=400 if errors else 200,
        title="Usage",
        filters=filters,
        errors=errors,
        tenants=tenants,
        usage=usage,
        charts=charts(usage) if usage is not None else [],
        rows=rows,
        pager=pager,
        totals=_display_totals(usage.totals) if usage is not None else None,
        csv_url=CSV_PATH + _query_string(query),
        prev_url=pager.link(PATH, pager.number - 1, query) if pager.number > 1 else None,
        next_url=pager.link(PATH, pager.number + 1, query) if pager.number < pager.last else None,
    )


def _query_string(query: list[tuple[str, str]]) -> str:
    kept = [(k, v) for k, v in query if v]
    return f"?{urlencode(kept)}" if kept else ""


def _display_totals(t: reports.UsageTotals) -> dict[str, str]:
    return {
        "requests": fmt_count(t.requests),
        "errors": fmt_count(t.errors),
        "prompt_tokens": fmt_count(t.prompt_tokens),
        "completion_tokens": fmt_count(t.completion_tokens),
        "total_tokens": fmt_count(t.total_tokens),
    }


# ---- CSV --------------------------------------------------------------------------------------


def csv_cell(value: str | int) -> str:
    """A CSV cell that spreadsheets show as text, never evaluate as a formula."""
    text = str(value)
    return "'" + text if text.startswith(FORMULA_START) else text


def csv_text(buckets: Iterable[reports.UsageBucket]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")  # RFC 4180
    writer.writerow(CSV_HEADER)
    for b in buckets:
        writer.writerow(
            csv_cell(v)
            for v in (
                b.date.isoformat(), b.tenant or OPERATOR, b.model, b.requests, b.errors,
                b.prompt_tokens, b.completion_tokens, b.total_tokens,
            )
        )  # fmt: skip
    return out.getvalue()


_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9._-]")


def csv_filename(usage: Usage, filters: Filters) -> str:
    parts = ["loraplex-usage", usage.days.start.isoformat(), usage.days.end.isoformat()]
    parts += [_UNSAFE_FILENAME.sub("_", v)[:64] for v in (filters.tenant, filters.model) if v]
    return "_".join(parts) + ".csv"


@router.get(CSV_PATH)
async def usage_csv(request: Request, admin: SignedIn) -> Response:
    filters = Filters.of(request)
    usage, _ = await load_usage(request, filters)
    if usage is None:  # the page, with the filters' problems marked
        return await usage_page(request, admin)
    ordered = sorted(usage.buckets, key=lambda b: (b.date, b.tenant or "", b.model))
    response = Response(
        csv_text(ordered).encode("utf-8"),
        media_type="text/csv; charset=utf-8",
        headers={
            "Content-Disposition": f'attachment; filename="{csv_filename(usage, filters)}"',
        },
    )
    return secure_headers(response)
