"""The Overview page: the engine now (refreshed by ``static/admin.js`` from ``overview.json``)
and the last hour as server-drawn charts (refreshed from ``overview/charts``): throughput, time
to first token, and each tenant's share of the tokens generated."""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from loraplex.webui.charts import Chart, line_chart
from loraplex.webui.context import (
    NavItem,
    Polling,
    SignedIn,
    render,
    secure_headers,
    webui_of,
)
from loraplex.webui.live import (
    NO_TENANT,
    OTHERS,
    TenantShares,
    Window,
    format_rate,
    format_seconds,
)
from loraplex.webui.tenant_picker import tenant_labels

NAV = NavItem("Overview", "/admin")
X_LABELS = ("60 min ago", "45", "30", "15", "now")

router = APIRouter(include_in_schema=False)


SHARE_CLASSES = ("series-a", "series-b", "series-c", "series-d", "series-e")


def share_chart(shares: TenantShares, names: dict[str, str]) -> Chart:
    """Each tenant's share of the tokens generated, a point a minute (the top five by tokens;
    the others together as one dashed line). Only tenants with tokens in the hour have a line
    (``tenant_shares``); ``names`` (``tenant_labels``) marks a suspended one as such."""
    lines = []
    for n, (key, values) in enumerate(shares.shares.items()):
        css = "series-f" if key == OTHERS else SHARE_CLASSES[n % len(SHARE_CLASSES)]
        lines.append((_tenant_label(key, names), css, values))
    whole = sum(shares.totals.values())
    parts = [
        f"{_tenant_label(k, names)} {n / whole:.0%}" for k, n in shares.totals.items() if whole
    ]
    summary = (
        f"Last hour: {', '.join(parts)} of {whole:,} tokens; one point per {shares.point_s:g} s."
        if parts
        else "Last hour: no tokens generated."
    )
    return line_chart("Share of generated tokens by tenant", lines, fmt=_percent,
                      x_labels=X_LABELS, summary=summary, y_max=1.0)  # fmt: skip


def _tenant_label(key: str, names: dict[str, str]) -> str:
    if key == OTHERS:
        return "other tenants"
    if key == NO_TENANT:
        return "operator"
    return names.get(key, f"deleted tenant {key}")


def _percent(value: float) -> str:
    return f"{value:.0%}"


def charts(window: Window) -> list[Chart]:
    requests = f"{window.requests:,} request{'s' if window.requests != 1 else ''}"
    throughput = line_chart(
        "Throughput (generated tokens/s)",
        [("tokens/s", "series-a", window.tokens_per_s)],
        fmt=format_rate,
        x_labels=X_LABELS,
        summary=(
            f"Last hour: {requests}, {window.tokens:,} tokens generated, "
            f"{window.errors:,} failed; one point per {window.slot_s:g} s."
        ),
    )
    latency = line_chart(
        "Time to first token",
        [
            ("p50", "series-a", window.ttft_p50_s),
            ("p99", "series-b", window.ttft_p99_s),
        ],
        fmt=format_seconds,
        x_labels=X_LABELS,
        scale="auto",  # a log scale when p99 dwarfs p50, which stays readable beside it
        summary=(
            f"Last hour: p50 {format_seconds(window.ttft_p50_all_s)}, "
            f"p99 {format_seconds(window.ttft_p99_all_s)} over {requests}."
        ),
    )
    return [throughput, latency]


async def _charts(request: Request) -> list[Chart]:
    webui = webui_of(request)
    shares = webui.recorder.tenant_shares()
    names = await webui.store.db.run(partial(tenant_labels, ids=list(shares.totals)))
    return [*charts(webui.recorder.window()), share_chart(shares, names)]


async def _state(request: Request) -> dict[str, Any]:
    webui = webui_of(request)
    return {"engine": await webui.monitor.read(), "charts": await _charts(request)}


@router.get("/admin")
async def overview(request: Request, admin: SignedIn) -> Response:
    return render(request, "overview.html", admin=admin, title="Overview", **await _state(request))


@router.get("/admin/overview.json")
async def overview_json(request: Request, admin: Polling) -> Response:
    view = await webui_of(request).monitor.read()
    response = JSONResponse({"engine": view.as_json()})
    return secure_headers(response)


@router.get("/admin/overview/charts")
async def overview_charts(request: Request, admin: Polling) -> Response:
    """The charts as an HTML fragment, which the page's script swaps in."""
    return render(request, "_charts.html", charts=await _charts(request))  # no admin: flashes stay
