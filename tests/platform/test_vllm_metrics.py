"""The ``vllm:`` families over one engine snapshot: requests (not samples), KV usage clamped to
[0, 1], the cache config, and ``lora_requests_info`` only while adapters are served (its lists
empty when none is in use); nothing when the engine does not answer. Adapter names are cached
for ``ttl_s`` and a failed read keeps the names known."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.info import NO_TENANT, AdapterRequests, EngineStats, LoRAStats, TenantStats
from loraplex.platform.vllm_metrics import AdapterNames, VllmCollector

pytestmark = pytest.mark.anyio


class Names:
    """The registry's answer, scripted: ``table``; counts the reads; ``fail`` makes one raise."""

    def __init__(self, table: dict[tuple[int, str], tuple[str, ...]]) -> None:
        self.table = table
        self.reads: list[list[tuple[int, str]]] = []
        self.fail = False

    async def served_names(
        self, wanted: Collection[tuple[int, str]]
    ) -> Mapping[tuple[int, str], tuple[str, ...]]:
        self.reads.append(sorted(wanted))
        if self.fail:
            raise OSError("database gone")
        return {p: self.table[p] for p in wanted if p in self.table}


def _samples(collector: VllmCollector) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry()
    registry.register(collector)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


async def test_families_from_one_snapshot() -> None:
    names = Names({(7, "h1"): ("acme/bot", "acme/bot@2")})
    collector = VllmCollector(
        lambda: "base",
        AdapterNames(lambda: {"h0": ("ops-adapter",)}, names),
        lambda: 4,
        clock=lambda: 1700000000.5,
    )
    await collector.update(None)
    assert not _samples(collector)  # the engine did not answer: no vllm: family at all

    stats = EngineStats(
        num_running=5,  # samples
        num_waiting=1,
        num_running_requests=2,
        num_waiting_requests=1,
        kv_cache_usage=1.0000001,  # rounding above 1 never reaches the pickers
        block_size=16,
        kv_blocks_total=320,
        lora=LoRAStats(),
        tenants={
            "7": TenantStats(adapters={"h1": AdapterRequests(running=1, waiting=1)}),
            NO_TENANT: TenantStats(adapters={"h0": AdapterRequests(running=1)}),
            "8": TenantStats(adapters={"h9": AdapterRequests(running=1)}),  # no name: left out
        },
    )
    await collector.update(stats)
    got = _samples(collector)
    assert got["vllm:num_requests_running"] == [({"model_name": "base"}, 2.0)]
    assert got["vllm:num_requests_waiting"] == [({"model_name": "base"}, 1.0)]
    assert got["vllm:kv_cache_usage_perc"] == [({"model_name": "base"}, 1.0)]
    assert got["vllm:cache_config_info"] == [
        ({"model_name": "base", "block_size": "16", "num_gpu_blocks": "320"}, 1.0)
    ]
    labels, value = got["vllm:lora_requests_info"][0]
    assert value == 1700000000.5
    assert labels == {
        "model_name": "base",
        "max_lora": "4",
        "running_lora_adapters": "acme/bot,acme/bot@2,ops-adapter",
        "waiting_lora_adapters": "acme/bot,acme/bot@2",
    }

    await collector.update(EngineStats(lora=LoRAStats()))  # adapters served, none in use
    labels, _ = _samples(collector)["vllm:lora_requests_info"][0]
    assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("", "")
    await collector.update(EngineStats())  # no adapters served: no lora_requests_info
    got = _samples(collector)
    assert "vllm:lora_requests_info" not in got and "vllm:num_requests_running" in got


async def test_names_are_cached_and_survive_a_failed_read() -> None:
    now = [0.0]
    names = Names({(7, "h1"): ("acme/bot@1",)})
    cache = AdapterNames(lambda: {}, names, ttl_s=5.0, clock=lambda: now[0])
    wanted = {("7", "h1")}
    assert await cache.names(wanted) == {("7", "h1"): ("acme/bot@1",)}
    assert await cache.names(wanted) == {("7", "h1"): ("acme/bot@1",)}
    assert len(names.reads) == 1  # within ttl_s: no second read
    now[0] = 6.0
    names.fail = True
    assert await cache.names(wanted) == {("7", "h1"): ("acme/bot@1",)}  # kept
    names.fail = False
    names.table[(7, "h1")] = ("acme/bot", "acme/bot@1")  # a newer version went away
    now[0] = 7.0
    assert await cache.names(wanted) == {("7", "h1"): ("acme/bot@1",)}
    assert len(names.reads) == 2  # after a failure, no read for ttl_s
    now[0] = 11.0
    assert await cache.names(wanted) == {("7", "h1"): ("acme/bot", "acme/bot@1")}
    assert await cache.names(set()) == {} and len(names.reads) == 3  # nothing wanted: no read
