"""Per-tenant engine metrics for ``/metrics``: what the scheduler gave each tenant, from the
engine's ``EngineStats.tenants`` at scrape time.

    loraplex_tenant_prompt_tokens_computed_total{tenant}  prompt tokens run for the tenant
    loraplex_tenant_generated_tokens_total{tenant}        tokens generated for it
    loraplex_tenant_virtual_service{tenant}               the fair policy's counter (weighted)
    loraplex_tenant_requests_running{tenant}              its requests running now
    loraplex_tenant_requests_waiting{tenant}              ... and waiting
    loraplex_tenant_weight{tenant}                        the weight the engine holds for it

``tenant`` is the engine's tenant key: the tenant's id from the registry (the platform sets it
on every request; a caller never chooses it), ``-`` for requests without a tenant. The set is
bounded by the tenants the registry has held since the engine started. The counters stay
monotonic across engine restarts as the engine-wide ones do (``MonotonicTotals``); the gauges
are the engine's now and are left out while it does not answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loraplex.engine.client import EngineStats, TenantStats
from loraplex.platform.engine_totals import MonotonicTotals

COUNTERS = {  # TenantStats field -> (family, help)
    "num_prompt_tokens_computed": (
        "loraplex_tenant_prompt_tokens_computed",
        "Prompt tokens the engine ran for the tenant (cache hits excluded, recomputation "
        "included).",
    ),
    "num_generated_tokens": (
        "loraplex_tenant_generated_tokens",
        "Tokens generated for the tenant.",
    ),
}
GAUGES = {
    "virtual_service": (
        "loraplex_tenant_virtual_service",
        "The fair policy's counter: the tenant's weighted service (the tenant with the lowest "
        "waiting one is served next).",
    ),
    "num_running": ("loraplex_tenant_requests_running", "The tenant's engine requests running."),
    "num_waiting": ("loraplex_tenant_requests_waiting", "The tenant's engine requests waiting."),
    "weight": ("loraplex_tenant_weight", "The tenant's scheduling weight in the engine."),
}


class TenantCollector:
    """A prometheus collector over the latest snapshot's tenants (``update`` before each
    collection; ``None``: the engine did not answer)."""

    def __init__(self) -> None:
        self._tenants: dict[str, TenantStats] = {}
        self.totals: MonotonicTotals[tuple[str, str]] = MonotonicTotals()

    def update(self, stats: EngineStats | None) -> None:
        self._tenants = {} if stats is None else dict(stats.tenants)
        if stats is not None:
            values = {
                (tenant, field): float(getattr(share, field))
                for tenant, share in stats.tenants.items()
                for field in COUNTERS
            }
            self.totals.update(values, stats.engine_restarts)

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        return list(self._families())

    def _families(self) -> Iterator[Metric]:
        known = sorted({tenant for tenant, _ in self.totals.counted()})
        for field, (name, doc) in COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["tenant"])
            for tenant in known:
                total = self.totals.total((tenant, field))
                if total is not None:
                    family.add_metric([tenant], total)
            yield family
        for field, (name, doc) in GAUGES.items():
            gauge = GaugeMetricFamily(name, doc, labels=["tenant"])
            for tenant, share in sorted(self._tenants.items()):
                value = getattr(share, field)
                if value is not None:
                    gauge.add_metric([tenant], float(value))
            yield gauge
