"""One ``EngineStats`` for several data-parallel replicas (``DataParallelClient.stats``).

Gauges (requests running and waiting, KV blocks, the adapter pool, residency) are summed over
the replicas that answered; ``kv_cache_usage`` is recomputed from the sums. Counters (tokens,
steps, prefix-cache queries, adapter loads, speculative drafts, per-tenant tokens) follow
``EngineStats``'s contract for one engine: totals since the last restart, with a change of
``engine_restarts`` saying when they started again. Here a "restart" is any replica's, and
``engine_restarts`` is the sum over the replicas; after one, each counter reports what the
replicas counted since the snapshot before it (the restarted replica: everything since it
came back). ``/metrics`` adds the last total it saw to an offset at each restart, so its series
neither lose the survivors' counts nor count them twice.

A replica that does not answer keeps its last counters (no increments) and adds no gauges.
Pure bookkeeping, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from loraplex.engine.info import (
    AdapterRequests,
    EngineStats,
    LoRAStats,
    SpecDecodeStats,
    TenantStats,
    Tier,
)

ENGINE_COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_evictions",
    "num_preemptions",
    "num_steps",
    "num_prompt_tokens_computed",
    "num_generated_tokens",
)
ENGINE_GAUGES = (
    "num_running",
    "num_waiting",
    "num_running_requests",
    "num_waiting_requests",
    "kv_blocks_total",
    "kv_blocks_used",
    "kv_blocks_free",
    "kv_blocks_cached",
)
LORA_COUNTERS = (
    "disk_loads",
    "host_hits",
    "host_evictions",
    "slot_loads",
    "slot_hits",
    "slot_evictions",
    "load_waits",
    "loads_deferred",
    "load_failures",
    "load_bytes",
)
LORA_GAUGES = (
    "loads_in_flight",
    "pool_pages",
    "pool_pages_used",
    "pool_bytes",
    "pool_bytes_used",
    "adapter_bytes",
    "resident_device",
    "resident_host",
)
SPEC_COUNTERS = (
    "num_verifications",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_emitted_tokens",
    "num_steps_off",
)
TENANT_COUNTERS = ("num_prompt_tokens_computed", "num_generated_tokens")
_TIER_RANK: dict[Tier, int] = {"device": 0, "host": 1, "disk": 2}

Counters = dict[tuple[Any, ...], float]


def counters_of(stats: EngineStats) -> Counters:
    """Every counter of ``stats`` by a flat key."""
    out: Counters = {("engine", f): getattr(stats, f) for f in ENGINE_COUNTERS}
    if stats.lora is not None:
        out |= {("lora", f): getattr(stats.lora, f) for f in LORA_COUNTERS}
    spec = stats.speculative
    if spec is not None:
        out |= {("spec", f): getattr(spec, f) for f in SPEC_COUNTERS}
        out |= {("spec_pos", j): v for j, v in enumerate(spec.accepted_per_position)}
    for tenant, share in stats.tenants.items():
        out |= {("tenant", tenant, f): getattr(share, f) for f in TENANT_COUNTERS}
    return out


class StatsCombiner:
    """Combines the replicas' snapshots; keeps, per replica, the last snapshot and the counters
    to subtract since the last restart of any replica (module doc)."""

    def __init__(self, num_replicas: int) -> None:
        self._last: list[EngineStats | None] = [None] * num_replicas
        self._base: list[Counters] = [{} for _ in range(num_replicas)]
        self._restarts = [0] * num_replicas

    def combine(
        self,
        snapshots: Sequence[EngineStats | None],
        adapter_keys: Collection[str] = (),
        *,
        num_inflight: int = 0,
    ) -> EngineStats:
        """``snapshots[i]``: replica i's stats, None when it did not answer. ``adapter_keys``:
        the adapters the data-parallel client holds (the disk tier of every replica)."""
        if len(snapshots) != len(self._last):
            raise ValueError(f"expected {len(self._last)} snapshots, got {len(snapshots)}")
        restarted = {
            i
            for i, s in enumerate(snapshots)
            if s is not None and s.engine_restarts != self._restarts[i]
        }
        if restarted:  # counters start again: from the last snapshot, or from zero
            for i, last in enumerate(self._last):
                self._base[i] = {} if i in restarted or last is None else counters_of(last)
        for i, s in enumerate(snapshots):
            if s is not None:
                self._last[i] = s
                self._restarts[i] = s.engine_restarts
        answered = [s for s in snapshots if s is not None]
        if not answered:
            raise ValueError("no replica answered")
        totals: Counters = {}
        for i, last in enumerate(self._last):
            if last is None:
                continue
            base = self._base[i]
            for key, value in counters_of(last).items():
                totals[key] = totals.get(key, 0.0) + value - base.get(key, 0.0)
        return self._build(answered, totals, adapter_keys, num_inflight)

    def _build(
        self,
        answered: list[EngineStats],
        totals: Counters,
        adapter_keys: Collection[str],
        num_inflight: int,
    ) -> EngineStats:
        first = answered[0]
        gauges = {f: sum(getattr(s, f) for s in answered) for f in ENGINE_GAUGES}
        fields: dict[str, Any] = {f: _int(totals.get(("engine", f), 0)) for f in ENGINE_COUNTERS}
        total_blocks = gauges["kv_blocks_total"]
        return dataclasses.replace(
            first,
            **gauges,
            **fields,
            kv_cache_usage=gauges["kv_blocks_used"] / total_blocks if total_blocks else 0.0,
            lora=_lora(answered, totals, adapter_keys),
            speculative=_spec(answered, totals),
            tenants=_tenants(answered, totals),
            num_inflight=num_inflight,
            engine_restarts=sum(self._restarts),
        )


def _int(value: float) -> int:
    return round(value)


def _lora(
    answered: list[EngineStats], totals: Counters, adapter_keys: Collection[str]
) -> LoRAStats | None:
    parts = [s.lora for s in answered if s.lora is not None]
    if not parts:
        return None
    residency: dict[str, Tier] | None = None
    if all(p.residency is not None for p in parts):
        residency = {key: "disk" for key in adapter_keys}
        for p in parts:
            assert p.residency is not None
            for key, tier in p.residency.items():
                held = residency.get(key)
                if held is None or _TIER_RANK[tier] < _TIER_RANK[held]:
                    residency[key] = tier
    registered = len(residency) if residency is not None else max(p.registered for p in parts)
    return LoRAStats(
        **{f: _int(totals.get(("lora", f), 0)) for f in LORA_COUNTERS},
        **{f: sum(getattr(p, f) for p in parts) for f in LORA_GAUGES},
        registered=registered,
        residency=residency,
        failed={k: why for p in parts for k, why in p.failed.items()},
    )


def _spec(answered: list[EngineStats], totals: Counters) -> SpecDecodeStats | None:
    parts = [s.speculative for s in answered if s.speculative is not None]
    if not parts:
        return None
    width = max(len(p.accepted_per_position) for p in parts)
    counts: dict[str, Any] = {f: _int(totals.get(("spec", f), 0)) for f in SPEC_COUNTERS}
    positions = tuple(_int(totals.get(("spec_pos", j), 0)) for j in range(width))
    return dataclasses.replace(parts[0], **counts, accepted_per_position=positions)


def _tenants(answered: list[EngineStats], totals: Counters) -> Mapping[str, TenantStats]:
    out: dict[str, TenantStats] = {}
    counted = [key[1] for key in totals if key[0] == "tenant"]
    for tenant in dict.fromkeys([*(t for s in answered for t in s.tenants), *counted]):
        shares = [s.tenants[tenant] for s in answered if tenant in s.tenants]
        services = [v.virtual_service for v in shares if v.virtual_service is not None]
        out[tenant] = TenantStats(  # a tenant only a silent replica served: its counters
            virtual_service=sum(services) if services else None,
            num_running=sum(v.num_running for v in shares),
            num_waiting=sum(v.num_waiting for v in shares),
            weight=shares[0].weight if shares else 1.0,
            adapters=_adapter_requests(shares),
            **{f: _int(totals.get(("tenant", tenant, f), 0)) for f in TENANT_COUNTERS},
        )
    return out


def _adapter_requests(shares: list[TenantStats]) -> dict[str, AdapterRequests]:
    """One tenant's requests per adapter, summed over the replicas (a request is on one)."""
    out: dict[str, AdapterRequests] = {}
    for share in shares:
        for key, n in share.adapters.items():
            had = out.get(key, AdapterRequests())
            out[key] = AdapterRequests(had.running + n.running, had.waiting + n.waiting)
    return out
