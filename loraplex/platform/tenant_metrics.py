"""Per-tenant engine metrics for ``/metrics``: what the scheduler gave each tenant, from the
engine's ``EngineStats.tenants`` at scrape time.

    loraplex_tenant_prompt_tokens_computed_total{tenant}  prompt tokens run for the tenant
    loraplex_tenant_generated_tokens_total{tenant}        tokens generated for it
    loraplex_tenant_virtual_service{tenant}               the fair policy's counter (weighted)
    loraplex_tenant_requests_running{tenant}              its requests running now
    loraplex_tenant_requests_waiting{tenant}              ... and waiting
    loraplex_tenant_weight{tenant}                        the weight the engine holds for it

``tenant`` is the engine's tenant key: the tenant's id from the registry (the platform sets it
on every request; a caller never chooses it), ``-`` for requests without a tenant. The labels
come from the metrics' ``LabelBudget``: past its cap, tenants are summed as ``_other`` (the
counters, running and waiting; a weight or a fair counter does not add up, so ``_other`` has
none), and a deleted tenant's series go at the next scrape (the engine still reports it). The
counters stay monotonic across engine restarts as the engine-wide ones do
(``MonotonicTotals``), ``_other``'s across deletions too (it keeps what deleted tenants in it
had); the gauges are the engine's now and are left out while it does not answer.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loraplex.engine.client import EngineStats, TenantStats
from loraplex.platform.engine_totals import MonotonicTotals
from loraplex.platform.metric_labels import OTHER, LabelBudget

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
SUMMED_GAUGES = ("num_running", "num_waiting")  # what _other shows of the gauges


class TenantCollector:
    """A prometheus collector over the latest snapshot's tenants (``update`` before each
    collection; ``None``: the engine did not answer). A tenant keeps the label it got first
    (its own or ``_other``), so no counter moves between series."""

    def __init__(self, labels: LabelBudget | None = None) -> None:
        self.labels = labels or LabelBudget()
        self._tenants: dict[str, TenantStats] = {}
        self._label: dict[str, str] = {}  # tenant -> its label, for every tenant counted
        self.totals: MonotonicTotals[tuple[str, str]] = MonotonicTotals()
        self._retired: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)  # deleted, in _other

    @property
    def counted(self) -> set[str]:
        """Every tenant with a series (or a part of _other's)."""
        return set(self._label)

    def update(self, stats: EngineStats | None, gone: Collection[str] = ()) -> None:
        """The engine's snapshot; ``gone``: tenants deleted since (their series go)."""
        for tenant in gone:
            if self._label.pop(tenant, None) == OTHER:  # what it had stays in _other's totals
                for field in COUNTERS:
                    self._retired[field] += self.totals.total((tenant, field)) or 0.0
            self.totals.forget([(tenant, field) for field in COUNTERS])
        if stats is None:
            self._tenants = {}
            return
        self._tenants = {t: share for t, share in stats.tenants.items() if t not in gone}
        for tenant in self._tenants:
            if tenant not in self._label:
                self._label[tenant] = self.labels.tenant(tenant)
        values = {
            (tenant, field): float(getattr(share, field))
            for tenant, share in self._tenants.items()
            for field in COUNTERS
        }
        self.totals.update(values, stats.engine_restarts)

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        return list(self._families())

    def _families(self) -> Iterator[Metric]:
        own = sorted(t for t, label in self._label.items() if label != OTHER)
        folded = [t for t, label in self._label.items() if label == OTHER]
        for field, (name, doc) in COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["tenant"])
            for tenant in own:
                total = self.totals.total((tenant, field))
                if total is not None:
                    family.add_metric([tenant], total)
            if folded or self._retired[field]:
                other = sum(self.totals.total((t, field)) or 0.0 for t in folded)
                family.add_metric([OTHER], self._retired[field] + other)
            yield family
        for field, (name, doc) in GAUGES.items():
            gauge = GaugeMetricFamily(name, doc, labels=["tenant"])
            summed: float | None = None
            for tenant, share in sorted(self._tenants.items()):
                value = getattr(share, field)
                if value is None:
                    continue
                if self._label[tenant] != OTHER:
                    gauge.add_metric([tenant], float(value))
                elif field in SUMMED_GAUGES:
                    summed = (summed or 0.0) + float(value)
            if summed is not None:
                gauge.add_metric([OTHER], summed)
            yield gauge
