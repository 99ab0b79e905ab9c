"""The model server protocol's metrics, in vLLM's names, beside the ``loraplex_*`` families: what
the Kubernetes inference stack's endpoint pickers (Gateway API Inference Extension / llm-d,
KServe, AIBrix) read to route a request to the pod that holds its adapter, has a short queue and
free KV. One series each, labelled ``model_name`` = the base model's served name::

    vllm:num_requests_running{model_name}       requests (the samples of an n > 1 one count once)
    vllm:num_requests_waiting{model_name}
    vllm:kv_cache_usage_perc{model_name}         fraction of the KV blocks in use, 0..1
    vllm:cache_config_info{model_name, block_size, num_gpu_blocks} 1
    vllm:lora_requests_info{model_name, max_lora, running_lora_adapters,
                            waiting_lora_adapters} <Unix time of the snapshot>

``lora_requests_info`` is there whenever the engine serves adapters, its lists empty when no
request uses one. Its lists are comma-joined ``model`` strings of the adapters with running
(waiting) requests, vLLM's meaning (not every resident adapter): every string that names the
content a request runs on, i.e. ``name@N`` and, for the newest version, ``name`` (gateway mode:
``tenant/name@N`` and ``tenant/name``, unique across tenants). An adapter whose names cannot be
read (a deleted tenant, the database not answering) is left out rather than named by its hash.
The engine reports requests per (tenant, content hash) (``TenantStats.adapters``); the names
come from the operator's adapters (``--lora-modules``) and the registry, cached for
``NAMES_TTL_S``. When the engine does not answer, none of these families is exposed (the
pickers count a pod without them as unable to serve).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

from loraplex.engine.info import NO_TENANT, EngineStats
from loraplex.platform.auth import Caller
from loraplex.platform.model_resolver import ModelResolver

logger = logging.getLogger(__name__)

NAMES_TTL_S = 5.0  # a new newest version's bare name shows within this
NAMES_TIMEOUT_S = 1.0

AdapterKey = tuple[str, str]  # (tenant label of EngineStats.tenants, adapter content hash)


class TenantAdapterNames(Protocol):
    """The registry's names of tenants' adapters (``RegistryModels.served_names``)."""

    async def served_names(
        self, wanted: Collection[tuple[int, str]]
    ) -> Mapping[tuple[int, str], tuple[str, ...]]: ...


def operator_adapter_names(resolver: ModelResolver) -> dict[str, tuple[str, ...]]:
    """Content hash -> the names of the operator's adapters (``--lora-modules``, vLLM's load
    route, the resolver directory; an alias is one more name of the same content)."""
    names: dict[str, list[str]] = {}
    for entry in resolver.list_models(Caller(id="operator")):
        if entry.adapter is not None:
            names.setdefault(entry.adapter.key, []).append(entry.name)
    return {key: tuple(sorted(n)) for key, n in names.items()}


class AdapterNames:
    """(tenant, content hash) -> the ``model`` strings naming it: the operator's adapters
    (``operator``: hash -> names, read each time) and tenants' (``tenants``: the registry, read
    for pairs unseen or older than ``ttl_s``; a failed or slow read keeps what was known)."""

    def __init__(
        self,
        operator: Callable[[], Mapping[str, tuple[str, ...]]],
        tenants: TenantAdapterNames | None = None,
        *,
        ttl_s: float = NAMES_TTL_S,
        timeout_s: float = NAMES_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.operator = operator
        self.tenants = tenants
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.clock = clock
        # only the pairs asked for last time: bounded by the requests in the engine
        self._known: dict[tuple[int, str], tuple[tuple[str, ...], float]] = {}
        self._quiet_until = float("-inf")  # no reads before (after a failed one)

    async def names(self, wanted: Collection[AdapterKey]) -> dict[AdapterKey, tuple[str, ...]]:
        operator = self.operator()
        out: dict[AdapterKey, tuple[str, ...]] = {
            (t, k): operator[k] for t, k in wanted if t == NO_TENANT and k in operator
        }
        pairs = {(int(t), k): (t, k) for t, k in wanted if t.isascii() and t.isdigit()}
        now = self.clock()
        known = {p: self._known[p] for p in pairs if p in self._known}
        stale = [p for p in pairs if p not in known or now - known[p][1] >= self.ttl_s]
        if stale and self.tenants is not None and now >= self._quiet_until:
            try:
                read = await asyncio.wait_for(self.tenants.served_names(stale), self.timeout_s)
            except Exception as exc:  # the names known stay; no read for ttl_s (a hung
                # database would otherwise get a new read, and a log line, every snapshot)
                self._quiet_until = now + self.ttl_s
                logger.warning("metrics: cannot read the adapters' names: %r", exc)
            else:
                known |= {p: (read.get(p, ()), now) for p in stale}
        self._known = known
        out |= {pairs[p]: names for p, (names, _) in known.items() if names}
        return out


@dataclass(frozen=True)
class _View:
    running: int
    waiting: int
    kv_usage: float
    block_size: int
    num_blocks: int
    lora: tuple[str, str] | None  # (running, waiting) lists; None: no adapters served
    at: float  # Unix time of the snapshot


class VllmCollector:
    """A prometheus collector of the ``vllm:`` families over the latest snapshot (``await
    update`` before each collection; ``None``: the engine did not answer)."""

    def __init__(
        self,
        model_name: Callable[[], str],
        names: AdapterNames,
        max_lora: Callable[[], int],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``model_name``: the base model's served name; ``max_lora``: adapters one step may
        use (``EngineInfo.max_loras``)."""
        self.model_name = model_name
        self.names = names
        self.max_lora = max_lora
        self.clock = clock
        self._view: _View | None = None

    async def update(self, stats: EngineStats | None) -> None:
        if stats is None:
            self._view = None
            return
        lora: tuple[str, str] | None = None
        if stats.lora is not None:
            running: set[AdapterKey] = set()
            waiting: set[AdapterKey] = set()
            for tenant, share in stats.tenants.items():
                for key, n in share.adapters.items():
                    if n.running:
                        running.add((tenant, key))
                    if n.waiting:
                        waiting.add((tenant, key))
            names = await self.names.names(running | waiting)
            lora = (_joined(names, running), _joined(names, waiting))
        self._view = _View(
            running=stats.num_running_requests,
            waiting=stats.num_waiting_requests,
            kv_usage=min(max(stats.kv_cache_usage, 0.0), 1.0),
            block_size=stats.block_size,
            num_blocks=stats.kv_blocks_total,
            lora=lora,
            at=self.clock(),
        )

    def describe(self) -> Iterable[Metric]:
        return list(self._families(include_all=True))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(include_all=False))

    def _families(self, include_all: bool) -> Iterator[Metric]:
        view = self._view
        if view is None and not include_all:
            return
        model = self.model_name() if view is not None else ""
        gauges = (
            (
                "vllm:num_requests_running",
                "Requests running (samples of one count once).",
                "running",
            ),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", "waiting"),
            ("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", "kv_usage"),
        )
        for name, doc, field in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            if view is not None:
                gauge.add_metric([model], float(getattr(view, field)))
            yield gauge
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV cache's configuration, in the labels.",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        if view is not None:
            info.add_metric([model, str(view.block_size), str(view.num_blocks)], 1.0)
        yield info
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Adapters with running and waiting requests (comma-joined model names); the value "
            "is the snapshot's Unix time.",
            labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        if view is not None and view.lora is not None:
            running, waiting = view.lora
            lora.add_metric([model, str(self.max_lora()), running, waiting], view.at)
        if include_all or lora.samples:
            yield lora


def _joined(names: Mapping[AdapterKey, tuple[str, ...]], keys: Iterable[AdapterKey]) -> str:
    return ",".join(sorted({name for key in keys for name in names.get(key, ())}))
