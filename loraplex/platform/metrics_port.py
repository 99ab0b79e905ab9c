"""``--metrics-port``: ``GET /metrics`` without credentials on a port of its own, for the scrapers
of the Kubernetes inference stack (an endpoint picker scrapes every pod 20 times a second and
sends no token; a NetworkPolicy fences the port). The main port keeps its token.

A scrape never reaches the engine: it answers with the latest ``MetricsSnapshot``, the exposition
text of the protocol's ``vllm:`` families, which the server takes every ``interval_s`` (one engine
round trip per snapshot, however many scrapers). The endpoint pickers call data older than two seconds
stale, so the interval stays well under that. Anything but ``GET``/``HEAD /metrics`` is 404 (405 for another
method; ``metrics_http.py``): the port serves nothing else.

Only the ``vllm:`` families (``vllm_metrics``; in gateway mode ``lora_requests_info`` names
adapters as ``tenant/name``, as documented): whoever reaches the port reads it, and the
``loraplex_*`` families carry each tenant's traffic by tenant id and its adapters' names. They stay
on the main port's ``/metrics``, behind the admin or metrics token (Prometheus scrapes there).
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, generate_latest

from loraplex.platform.metrics import PlatformMetrics

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.5


class MetricsSnapshot:
    """The exposition text as of the last ``refresh`` (``run`` refreshes it forever)."""

    def __init__(self, metrics: PlatformMetrics, interval_s: float = SNAPSHOT_INTERVAL_S) -> None:
        if not interval_s > 0:
            raise ValueError(f"the snapshot interval must be above 0 s; got {interval_s}")
        self.metrics = metrics
        self.interval_s = interval_s
        # The protocol's families alone (the collector is in the main registry too).
        self.registry = CollectorRegistry()
        if metrics.vllm is not None:
            self.registry.register(metrics.vllm)
        self.text = b""
        self.taken_at: float | None = None  # time.monotonic() of the last snapshot
        self.taken = 0  # snapshots taken (tests count them)

    async def refresh(self) -> None:
        await self.metrics.scrape()  # one engine read updates every collector, vllm: included
        self.text = generate_latest(self.registry)
        self.taken_at = time.monotonic()
        self.taken += 1

    async def run(self) -> None:
        """Refresh every ``interval_s`` until cancelled; a failed refresh keeps the last text."""
        while True:
            started = time.monotonic()
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # the scrapers keep the last text; the next round tries again
                logger.exception("metrics: the snapshot for --metrics-port failed")
            await asyncio.sleep(max(self.interval_s - (time.monotonic() - started), 0.0))
