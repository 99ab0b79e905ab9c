"""The Overview page: the engine now (refreshed by ``static/admin.js`` from ``overview.json``)
and the last hour as two server-drawn charts (refreshed from ``overview/charts``)."""

from __future__ import annotations

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
from loraplex.webui.live import Window, format_rate, format_seconds

NAV = NavItem("Overview", "/admin")
X_LABELS = ("60 min ago", "45", "30", "15", "now")

router = APIRouter(include_in_schema=False)


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
        summary=(
            f"Last hour: p50 {format_seconds(window.ttft_p50_all_s)}, "
            f"p99 {format_seconds(window.ttft_p99_all_s)} over {requests}."
        ),
    )
    return [throughput, latency]


async def _state(request: Request) -> dict[str, Any]:
    webui = webui_of(request)
    return {
        "engine": await webui.monitor.read(),
        "charts": charts(webui.recorder.window()),
    }


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
    window = webui_of(request).recorder.window()
    return render(request, "_charts.html", charts=charts(window))  # no admin: flashes stay
