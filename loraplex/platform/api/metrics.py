"""``GET /metrics``: the Prometheus text (audience "metrics": the metrics token or the
operator)."""

from __future__ import annotations

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from loraplex.platform.deps import MetricsDep

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(registry: MetricsDep) -> Response:
    return Response(await registry.scrape(), media_type=CONTENT_TYPE_LATEST)
