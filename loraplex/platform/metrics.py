"""Prometheus metrics: ``GET /metrics`` in the text format, from one ``CollectorRegistry`` per app.

Two sources:

* **platform** metrics, observed once per finished API request from its ``RequestRecord`` (the
  request log's observer): requests by status, prompt and generation tokens, time to first
  token, time per output token, end-to-end latency, and the engine's queue time (carried on the
  first output of each engine request);
* **engine** metrics, read from ``EngineClient.stats()`` at scrape time (within
  ``stats_timeout``): running and waiting requests, KV cache usage, prefix-cache queries and hits,
  preemptions, adapter loads, evictions and residency per tier, the device adapter pool's pages
  and bytes, where each adapter version is (``adapter_metrics.py``: labelled by registry version
  id, capped), speculative decoding's draft, accepted and emitted tokens and acceptance rate
  (labelled by proposer ``method``), and per tenant what the scheduler gave it
  (``tenant_metrics.py``); and the model server protocol's ``vllm:`` families, for the
  Kubernetes inference stack's endpoint pickers (``vllm_metrics.py``). When the engine does not
  answer, the scrape still succeeds:
  ``loraplex_engine_healthy 0``, the engine's gauges left out, its counters at their last known
  totals.

Labels are bounded. ``model`` is the served name the request resolved to (the base model or a
loaded adapter), or ``_unresolved`` when it did not resolve: never the string the caller sent.
``tenant`` is the caller's tenant id from the registry, ``-`` for the operator.
``endpoint`` is ``completions`` or ``chat_completions``; ``status`` the HTTP status
(499: the client left first; an error sent inside a stream counts with that error's status).
Tenants and adapter versions get their own labels up to a cap (``metrics_max_tenants``,
``metrics_max_adapters``; the rest are summed as ``_other``), and a tenant's or a version's
series are removed at the first scrape after it is deleted (``metric_labels.LabelBudget``).

Engine counters stay monotonic across engine restarts: the engine process starts again from
zero, so each counter carries an offset that grows by the last total seen before every reset (a
reset is a change of ``engine_restarts``, or a total that went down). Increments between the last
scrape and a crash are lost; the series never goes backwards.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from loraplex.engine.client import EngineClient, EngineStats
from loraplex.platform.adapter_metrics import (
    AdapterVersionIndex,
    FailedCollector,
    ResidencyCollector,
)
from loraplex.platform.db.database import Database
from loraplex.platform.engine_state import EngineNotAnswering, read_engine_stats
from loraplex.platform.engine_totals import MonotonicTotals
from loraplex.platform.metric_labels import (
    MAX_ADAPTERS,
    MAX_TENANTS,
    Gone,
    LabelBudget,
)
from loraplex.platform.request_log import RequestRecord
from loraplex.platform.tenant_metrics import TenantCollector
from loraplex.platform.vllm_metrics import VllmCollector

logger = logging.getLogger(__name__)

UNRESOLVED_MODEL = "_unresolved"
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}

# Seconds. From a warm GPU (milliseconds) to a long prompt on a shared CPU (minutes).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
TOKEN_GAP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
)  # fmt: skip


class PlatformMetrics:
    """The app's metrics registry; ``observe`` each finished request, ``scrape`` for the text."""

    def __init__(
        self,
        client: EngineClient,
        *,
        stats_timeout: float = 3.0,
        versions: AdapterVersionIndex | None = None,
        db: Database | None = None,
        max_tenants: int = MAX_TENANTS,
        max_adapters: int = MAX_ADAPTERS,
        vllm: VllmCollector | None = None,
    ) -> None:
        """``versions``: the registry's adapter versions, for the residency gauge's labels
        (None: no registry; every adapter counts in ``_other``). ``db``: the platform's
        database, where deleted tenants and versions are found (None: none ever is);
        ``max_tenants`` and ``max_adapters``: the caps on their own labels. ``vllm``: the
        model server protocol's ``vllm:`` families (``vllm_metrics``; None: not exposed)."""
        self.client = client
        self.stats_timeout = stats_timeout
        self.labels = LabelBudget(db, max_tenants=max_tenants, max_adapters=max_adapters)
        # (model, tenant) -> the (endpoint, status) pairs of its request counter: what a
        # deletion removes (prometheus_client has no public list of a metric's children)
        self._series: dict[tuple[str, str], set[tuple[str, str]]] = {}
        self.registry = CollectorRegistry()
        per_model = ("model", "tenant")

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, per_model, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = per_model) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        self.requests = counter(
            "loraplex_requests",
            "Completion and chat-completion requests, by HTTP status (499: the client left).",
            ("model", "tenant", "endpoint", "status"),
        )
        self.prompt_tokens = counter("loraplex_prompt_tokens", "Prompt tokens of requests run.")
        self.generation_tokens = counter(
            "loraplex_generation_tokens", "Tokens generated (also for requests left early)."
        )
        self.ttft = histogram(
            "loraplex_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "loraplex_time_per_output_token_seconds",
            "Mean time between consecutive tokens of a choice, one observation per request.",
            TOKEN_GAP_BUCKETS,
        )
        self.e2e = histogram(
            "loraplex_e2e_request_latency_seconds",
            "From the request's arrival to its end, for requests that ran in the engine.",
            E2E_BUCKETS,
        )
        self.queue_time = histogram(
            "loraplex_request_queue_time_seconds",
            "Time in the engine's waiting queue before first being scheduled.",
            LATENCY_BUCKETS,
        )
        self.engine = EngineCollector()
        self.registry.register(self.engine)
        self.tenants = TenantCollector(self.labels)
        self.registry.register(self.tenants)
        self.residency = ResidencyCollector(versions)
        self.registry.register(self.residency)
        self.failed = FailedCollector(db)
        self.registry.register(self.failed)
        self.vllm = vllm
        if vllm is not None:
            self.registry.register(vllm)
        self._scrape_lock = asyncio.Lock()  # snapshots reach the collector in order

    def observe(self, record: RequestRecord) -> None:
        """Count a finished request (a ``RequestLogMiddleware`` observer)."""
        endpoint = ENDPOINTS.get(record.path)
        if endpoint is None:
            return
        tenant = self.labels.tenant(record.tenant_id)
        model = record.served_model or UNRESOLVED_MODEL
        if record.lora_key is not None and record.served_model is not None:
            model = self.labels.adapter(tenant, model, record.adapter_version_id)
        status = str(record.stream_error_status or record.status or 500)
        self._series.setdefault((model, tenant), set()).add((endpoint, status))
        self.requests.labels(model, tenant, endpoint, status).inc()
        if not record.generated:
            return
        self.prompt_tokens.labels(model, tenant).inc(record.prompt_tokens)
        self.generation_tokens.labels(model, tenant).inc(record.completion_tokens)
        self.e2e.labels(model, tenant).observe(record.latency())
        if record.first_token_time is not None:
            self.ttft.labels(model, tenant).observe(max(record.first_token_time - record.start, 0))
        if record.time_per_output_token is not None:
            self.tpot.labels(model, tenant).observe(record.time_per_output_token)
        if record.queue_time is not None:
            self.queue_time.labels(model, tenant).observe(record.queue_time)

    async def scrape(self) -> bytes:
        """The exposition text, with the engine's numbers as of now."""
        async with self._scrape_lock:
            stats: EngineStats | None = None
            if self.client.healthy:
                try:
                    stats = await read_engine_stats(self.client, self.stats_timeout)
                except EngineNotAnswering as exc:  # what loraplex_engine_healthy reports
                    logger.warning("metrics: no engine stats: %s", exc.reason)
            reported = stats.tenants if stats is not None else {}
            gone = await self.labels.gone({*reported, *self.tenants.counted})
            self._remove(gone)
            self.engine.update(stats)
            self.tenants.update(stats, gone.tenants)
            await self.residency.update(stats)
            await self.failed.update(stats)
            if self.vllm is not None:
                await self.vllm.update(stats)
            return generate_latest(self.registry)

    def _remove(self, gone: Gone) -> None:
        """Remove the request series of deleted tenants and adapter versions."""
        doomed = [
            (model, tenant)
            for model, tenant in self._series
            if tenant in gone.tenants or (tenant, model) in gone.adapters
        ]
        per_model = (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot,
                     self.e2e, self.queue_time)  # fmt: skip
        for model, tenant in doomed:
            for endpoint, status in self._series.pop((model, tenant)):
                self.requests.remove(model, tenant, endpoint, status)
            for metric in per_model:
                metric.remove(model, tenant)  # absent (nothing generated): a no-op


# ---- engine metrics ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _EngineCounter:
    key: str  # an EngineStats field, or lora_<LoRAStats field>
    name: str  # without _total
    doc: str
    tier: str | None = None  # the ``tier`` label of adapter counters


ADAPTER_LOADS_DOC = (
    "Adapter loads by tier: device, copies into the device pool; host, adapters parsed from "
    "disk into host memory."
)
ENGINE_COUNTERS = (
    _EngineCounter(
        "num_preemptions", "loraplex_preemptions", "Requests preempted (KV full; recomputed)."
    ),
    _EngineCounter(
        "prefix_cache_queries",
        "loraplex_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    _EngineCounter(
        "prefix_cache_hits",
        "loraplex_prefix_cache_hits",
        "Prompt tokens served from the prefix cache.",
    ),
    _EngineCounter(
        "prefix_cache_evictions",
        "loraplex_prefix_cache_evictions",
        "Cached KV blocks evicted to hold other tokens.",
    ),
    _EngineCounter("num_steps", "loraplex_engine_steps", "Engine steps (forward passes)."),
    _EngineCounter(
        "num_prompt_tokens_computed",
        "loraplex_engine_prompt_tokens_computed",
        "Prompt tokens run through the model (cache hits excluded, recomputation included).",
    ),
    _EngineCounter("lora_slot_loads", "loraplex_adapter_loads", ADAPTER_LOADS_DOC, "device"),
    _EngineCounter("lora_disk_loads", "loraplex_adapter_loads", ADAPTER_LOADS_DOC, "host"),
    _EngineCounter(
        "lora_slot_evictions", "loraplex_adapter_evictions", "Adapter evictions by tier.", "device"
    ),
    _EngineCounter(
        "lora_host_evictions", "loraplex_adapter_evictions", "Adapter evictions by tier.", "host"
    ),
    _EngineCounter(
        "lora_load_waits",
        "loraplex_adapter_load_waits",
        "Engine steps that waited for an adapter's copy into the device pool.",
    ),
    _EngineCounter(
        "lora_loads_deferred",
        "loraplex_adapter_loads_deferred",
        "Adapter loads put off: the device pool was full of adapters in use or pinned.",
    ),
    _EngineCounter(
        "lora_load_bytes", "loraplex_adapter_load_bytes", "Bytes copied into the device pool."
    ),
)

# stats key -> (gauge, help)
ENGINE_GAUGES = {
    "num_running": ("loraplex_requests_running", "Engine requests (samples) running."),
    "num_waiting": ("loraplex_requests_waiting", "Engine requests (samples) waiting."),
    "num_inflight": ("loraplex_engine_inflight_requests", "API requests in the engine client."),
    "kv_cache_usage": ("loraplex_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1)."),
    "kv_blocks_used": ("loraplex_kv_cache_used_blocks", "KV blocks in use."),
    "kv_blocks_total": ("loraplex_kv_cache_usable_blocks", "KV blocks the engine can hand out."),
    "lora_adapter_bytes": (
        "loraplex_adapter_weight_bytes",
        "The device-resident adapters' own weights, at their ranks (pool bytes used over this: "
        "the padding).",
    ),
    "lora_loads_in_flight": (
        "loraplex_adapter_loads_in_flight",
        "Adapter copies into the device pool under way.",
    ),
}

# gauge -> (help, LoRAStats field of the whole, field of the part used): state="used"|"free"
POOL_GAUGES = {
    "loraplex_adapter_pool_pages": (
        "Pages of the device adapter pool (one page: a rank-row in every layer), used and free.",
        "pool_pages",
        "pool_pages_used",
    ),
    "loraplex_adapter_pool_bytes": (
        "Device memory of the adapter pool, used by resident adapters and free.",
        "pool_bytes",
        "pool_bytes_used",
    ),
}

# LoRAStats field -> tier of loraplex_adapters_resident ("disk": every adapter registered)
RESIDENCY = {"resident_device": "device", "resident_host": "host", "registered": "disk"}

# SpecDecodeStats field -> (counter without _total, help); labelled by the proposer's method
SPEC_COUNTERS = {
    "num_draft_tokens": (
        "loraplex_spec_decode_draft_tokens",
        "Draft tokens the target model verified (speculative decoding).",
    ),
    "num_accepted_tokens": (
        "loraplex_spec_decode_accepted_tokens",
        "Draft tokens the target model accepted.",
    ),
    "num_emitted_tokens": (
        "loraplex_spec_decode_emitted_tokens",
        "Tokens emitted by steps that verified drafts (accepted drafts plus one each).",
    ),
    "num_verifications": (
        "loraplex_spec_decode_verifications",
        "Request steps that verified at least one draft token.",
    ),
}


def engine_value(stats: EngineStats, key: str) -> float | None:
    """The number ``key`` names in ``stats``: an ``EngineStats`` field, or ``lora_<field>`` of
    its LoRA part (None when the engine serves no adapters)."""
    if key.startswith("lora_"):
        return None if stats.lora is None else float(getattr(stats.lora, key[5:]))
    if key.startswith("spec_"):
        spec = stats.speculative
        return None if spec is None else float(getattr(spec, key[5:]))
    return float(getattr(stats, key))


class EngineCollector:
    """A prometheus collector over the latest ``stats()`` snapshot (``update`` before each
    collection; ``None``: the engine did not answer)."""

    def __init__(self) -> None:
        self.healthy = False
        self._stats: EngineStats | None = None
        self._restarts: int | None = None  # kept by the client: monotonic already
        self._spec_method: str | None = None  # the proposer last seen (speculative decoding)
        self.totals: MonotonicTotals[str] = MonotonicTotals()

    def update(self, stats: EngineStats | None) -> None:
        self.healthy = stats is not None
        self._stats = stats
        if stats is not None:
            values = {c.key: engine_value(stats, c.key) for c in ENGINE_COUNTERS}
            values |= {f"spec_{k}": engine_value(stats, f"spec_{k}") for k in SPEC_COUNTERS}
            kept = {k: v for k, v in values.items() if v is not None}
            if stats.speculative is not None:
                self._spec_method = stats.speculative.method
            self.totals.update(kept, stats.engine_restarts)
            self._restarts = stats.engine_restarts

    def describe(self) -> Iterable[Metric]:
        return list(self._families(include_all=True))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(include_all=False))

    def _families(self, include_all: bool) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "loraplex_engine_healthy",
            "1 when the engine answered this scrape, else 0.",
            value=1.0 if self.healthy else 0.0,
        )
        if include_all or self._restarts is not None:
            yield CounterMetricFamily(
                "loraplex_engine_restarts", "Engine process restarts.", value=self._restarts or 0
            )
        counters: dict[str, CounterMetricFamily] = {}
        for c in ENGINE_COUNTERS:
            total = self.totals.total(c.key)
            if total is None and not include_all:
                continue
            family = counters.get(c.name)
            if family is None:
                labels = ["tier"] if c.tier else []
                family = counters[c.name] = CounterMetricFamily(c.name, c.doc, labels=labels)
            if total is not None:
                family.add_metric([c.tier] if c.tier else [], total)
        yield from counters.values()
        queries = self.totals.total("prefix_cache_queries")
        hits = self.totals.total("prefix_cache_hits")
        if include_all or queries is not None:
            yield GaugeMetricFamily(
                "loraplex_prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache, as a fraction of those looked up.",
                value=(hits or 0.0) / queries if queries else 0.0,
            )
        stats = self._stats
        for key, (name, doc) in ENGINE_GAUGES.items():
            value = engine_value(stats, key) if stats is not None else None
            if include_all or value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value or 0))
        resident = GaugeMetricFamily(
            "loraplex_adapters_resident",
            "Adapters per tier: the device pool, host memory, disk (every registered adapter).",
            labels=["tier"],
        )
        lora = stats.lora if stats is not None else None
        for key, tier in RESIDENCY.items():
            if lora is not None:
                resident.add_metric([tier], float(getattr(lora, key)))
        if include_all or resident.samples:
            yield resident
        for name, (doc, whole, part) in POOL_GAUGES.items():
            pool = GaugeMetricFamily(name, doc, labels=["state"])
            if lora is not None:
                used = float(getattr(lora, part))
                pool.add_metric(["used"], used)
                pool.add_metric(["free"], max(float(getattr(lora, whole)) - used, 0.0))
            if include_all or pool.samples:
                yield pool
        yield from self._spec_families(include_all)

    def _spec_families(self, include_all: bool) -> Iterator[Metric]:
        method = self._spec_method
        if method is None and not include_all:
            return
        for key, (name, doc) in SPEC_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["method"])
            total = self.totals.total(f"spec_{key}")
            if method is not None and total is not None:
                family.add_metric([method], total)
            yield family
        rate = GaugeMetricFamily(
            "loraplex_spec_decode_acceptance_rate",
            "Draft tokens accepted over draft tokens verified (totals across engine restarts).",
            labels=["method"],
        )
        drafted = self.totals.total("spec_num_draft_tokens")
        if method is not None and drafted is not None:
            accepted = self.totals.total("spec_num_accepted_tokens") or 0.0
            rate.add_metric([method], accepted / drafted if drafted else 0.0)
        yield rate
