"""The data-parallel client over real engine replicas on a tiny random model: with 2 replicas and
8 adapters, affinity routing loads each adapter on one replica and round robin on both, with the
same greedy outputs; removal unloads every copy; stats add up; a killed replica's in-flight
requests fail fast with EngineDeadError while new ones go to the survivor; and the merged
counters stay right across a replica's restart."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
from collections.abc import Iterator

import pytest

from loraplex import SamplingParams
from loraplex.bench.adapters import make_random_adapters
from loraplex.config import EngineConfig, LoRAConfig
from loraplex.engine.client import AdapterNotLoadedError, EngineDeadError, EngineStats
from loraplex.engine.dp_client import DataParallelClient, replica_placements, usable_cpu_list
from loraplex.engine.dp_stats import StatsCombiner
from loraplex.engine.info import LoRAStats, TenantStats
from loraplex.engine.inproc_client import InprocEngineClient
from loraplex.engine.proc_client import ProcEngineClient
from loraplex.platform.engine_totals import MonotonicTotals
from tests.utils.clients import Harness, collect, engine_config, sample_tokens
from tests.utils.models import make_tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _config(model_dir: str, **overrides: int) -> EngineConfig:
    return dataclasses.replace(
        engine_config(model_dir, **overrides), lora=LoRAConfig(max_loras=8, max_lora_rank=8)
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("dp")
    model_dir = make_tiny_model(root / "m", "llama", seed=4)
    return model_dir, make_random_adapters(model_dir, root / "adapters", 8, rank=8, seed=3)


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def _mix(num_requests: int, num_adapters: int, seed: int = 0) -> list[int]:
    """Every adapter once per cycle, cycles shuffled (as ``bench replicas``)."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < num_requests:
        order += rng.sample(range(num_adapters), num_adapters)
    return order[:num_requests]


async def _steady_mix(client: DataParallelClient, keys: list[str], tag: str) -> list[list[int]]:
    """48 requests over the adapters, 4 in flight at a time."""
    mix = _mix(48, len(keys))
    outs: list[list[int]] = []
    for wave in range(0, len(mix), 4):
        streams = [
            collect(client.generate(f"{tag}{i}", [3 + i % 5, 7, 9, 11], GREEDY, lora_key=keys[k]))
            for i, k in enumerate(mix[wave : wave + 4], wave)
        ]
        outs += [sample_tokens(d) for d in await asyncio.gather(*streams)]
    return outs


def test_affinity_keeps_each_adapter_on_one_replica_round_robin_spreads_them(
    model: tuple[str, dict[str, str]], harness: Harness
) -> None:
    model_dir, adapters = model
    config = _config(model_dir)
    client = DataParallelClient([InprocEngineClient(config, model_dir) for _ in range(2)])
    harness.run(client.start())
    try:
        keys = [harness.run(client.add_lora(name, path)).key for name, path in adapters.items()]
        # added alternately: 4 each
        assert [set(c) for c in client.adapter_loads] == [set(keys[0::2]), set(keys[1::2])]

        affine = harness.run(_steady_mix(client, keys, "aff"), timeout=120)
        placed = [{k for k, n in loads.items() if n} for loads in client.adapter_loads]
        assert all(sum(loads.values()) == 4 for loads in client.adapter_loads)  # no lazy load
        assert not placed[0] & placed[1] and placed[0] | placed[1] == set(keys)

        before = [sum(loads.values()) for loads in client.adapter_loads]
        client.set_routing("round_robin")
        spread = harness.run(_steady_mix(client, keys, "rr"), timeout=120)
        lazy = [
            sum(loads.values()) - b for loads, b in zip(client.adapter_loads, before, strict=True)
        ]
        on_both = [k for k in keys if all(k in loads for loads in client.adapter_loads)]
        assert len(on_both) >= 6 and sum(lazy) == len(on_both), (lazy, on_both)
        assert spread == affine  # routing never changes what is generated

        stats = harness.run(client.stats())
        one = harness.run(client.replicas[0].stats())
        assert stats.kv_blocks_total == 2 * one.kv_blocks_total
        assert stats.num_generated_tokens == 2 * 48 * GREEDY.max_tokens
        assert stats.lora is not None and stats.lora.registered == 8
        assert stats.lora.disk_loads == 8 + sum(lazy)

        for key in keys:
            harness.run(client.remove_lora(key))
        assert not any(r.has_lora(k) for r in client.replicas for k in keys)
        assert not any(client.has_lora(k) for k in keys)
    finally:
        harness.run(client.shutdown(timeout=1.0))


def test_bad_requests_fail_at_the_call_and_abort_ends_a_stream(
    model: tuple[str, dict[str, str]], harness: Harness
) -> None:
    model_dir, _ = model
    client = DataParallelClient([InprocEngineClient(_config(model_dir), model_dir)])
    harness.run(client.start())
    try:
        with pytest.raises(ValueError, match="prompt is empty"):
            client.generate("a", [], GREEDY)
        with pytest.raises(AdapterNotLoadedError, match="not loaded"):
            client.generate("b", [1, 2], GREEDY, lora_key="f" * 64)

        async def abort_one() -> list[str | None]:
            long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
            stream = client.generate("c", [5, 6, 7], long)
            await stream.__anext__()
            with pytest.raises(ValueError, match="already in use"):
                client.generate("c", [5, 6, 7], long)
            await client.abort("c")
            return [d.finish_reason async for d in stream]

        assert harness.run(abort_one())[-1] == "abort"
        assert client.num_inflight == 0
    finally:
        harness.run(client.shutdown(timeout=1.0))


def test_a_killed_replica_fails_its_requests_fast_and_the_survivor_serves(
    model: tuple[str, dict[str, str]], harness: Harness
) -> None:
    model_dir, adapters = model
    config = _config(model_dir, max_model_len=512, num_blocks=600)  # room for long streams
    two_cpus = len(usable_cpu_list()) >= 2
    placements = [p for p, _ in replica_placements(2, "cpu")] if two_cpus else [None, None]
    replicas = [ProcEngineClient(config, model_dir, num_threads=1, placement=p) for p in placements]
    client = DataParallelClient(replicas)
    harness.run(client.start(), timeout=120)
    try:
        for replica, placement in zip(replicas, placements, strict=True):
            if placement is not None:  # each engine process runs on its own CPUs only
                assert replica.pid is not None
                assert os.sched_getaffinity(replica.pid) == set(placement.cpus)
        (name, path), *_ = adapters.items()
        lora = harness.run(client.add_lora(name, path))
        assert replicas[0].has_lora(lora.key) and not replicas[1].has_lora(lora.key)
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

        async def kill_one() -> tuple[list[object], list[object], float]:
            loop = asyncio.get_running_loop()
            streams = [client.generate(f"k{i}", [5 + i, 6, 7], long) for i in range(4)]
            for stream in streams:
                await stream.__anext__()  # running in its engine
            on = {i: client._routes[f"k{i}"] for i in range(4)}
            assert sorted(on.values()) == [0, 0, 1, 1]  # least loaded: two each
            pid = replicas[0].pid
            assert pid is not None
            killed_at = loop.time()
            os.kill(pid, signal.SIGKILL)
            dead = [s for i, s in enumerate(streams) if on[i] == 0]
            alive = [s for i, s in enumerate(streams) if on[i] == 1]
            failed = await asyncio.gather(*(collect(s) for s in dead), return_exceptions=True)
            latency = loop.time() - killed_at
            assert client.healthy and not replicas[0].healthy
            # New requests go to the survivor at once, the adapter loaded there on demand.
            fresh = await asyncio.gather(
                collect(client.generate("new-base", [9, 10, 11], GREEDY)),
                collect(client.generate("new-lora", [9, 10, 11], GREEDY, lora_key=lora.key)),
            )
            for stream in alive:  # the survivor's requests go on; then they are let go
                assert (await stream.__anext__()).finish_reason is None
                await stream.aclose()
            return list(failed), fresh, latency

        failed, served, latency = harness.run(kill_one(), timeout=120)
        print(f"\nkill -9 of one replica -> EngineDeadError: {latency * 1000:.1f} ms")
        assert all(isinstance(f, EngineDeadError) for f in failed), failed
        assert latency < 5
        assert [d[-1].finish_reason for d in served] == ["length"] * 2  # type: ignore[index]
        assert client.adapter_loads[1][lora.key] == 1

        async def back() -> EngineStats:
            while not replicas[0].healthy:
                await asyncio.sleep(0.05)
            return await client.stats()

        stats = harness.run(back(), timeout=120)
        assert stats.engine_restarts == 1 and client.engine_restarts == 1
        assert stats.num_inflight == 0 and stats.num_running == 0

        async def rejoined() -> int | None:  # the restarted replica takes requests again
            stream = client.generate("after", [9, 10, 11], GREEDY)
            await stream.__anext__()
            index = client._routes["after"]
            await stream.aclose()
            return index

        assert harness.run(rejoined()) == 0  # both idle: the lowest index
    finally:
        harness.run(client.shutdown(timeout=1.0))


def _snapshot(tokens: int, restarts: int, tenant_tokens: int = 0, loads: int = 0) -> EngineStats:
    return EngineStats(
        num_generated_tokens=tokens,
        kv_blocks_total=10,
        kv_blocks_used=2,
        engine_restarts=restarts,
        lora=LoRAStats(disk_loads=loads, residency={"k": "host"}),
        tenants={"t": TenantStats(num_generated_tokens=tenant_tokens)},
    )


def test_merged_counters_neither_lose_nor_double_count_across_a_restart() -> None:
    combiner = StatsCombiner(2)
    totals: MonotonicTotals[str] = MonotonicTotals()  # what /metrics does with them

    def scrape(a: EngineStats | None, b: EngineStats | None) -> EngineStats:
        stats = combiner.combine([a, b], ["k", "other"])
        totals.update({"tokens": stats.num_generated_tokens}, stats.engine_restarts)
        return stats

    first = scrape(_snapshot(100, 0, 7, 1), _snapshot(50, 0, 3))
    assert first.num_generated_tokens == 150 and first.tenants["t"].num_generated_tokens == 10
    assert first.kv_blocks_total == 20 and first.kv_cache_usage == 0.2
    assert first.lora is not None and first.lora.residency == {"k": "host", "other": "disk"}
    assert first.lora.registered == 2 and first.lora.disk_loads == 1
    scrape(_snapshot(120, 0), None)  # replica 1 died: its counters stay, its gauges go
    after = scrape(_snapshot(130, 0), _snapshot(5, 1))  # it is back, counting from zero
    assert after.engine_restarts == 1
    assert totals.total("tokens") == 130 + 50 + 5  # every token once
    scrape(_snapshot(140, 0), _snapshot(9, 1))
    assert totals.total("tokens") == 140 + 50 + 9


def test_each_replica_gets_its_own_share_of_the_cpus() -> None:
    cpus = usable_cpu_list()
    (whole, threads), *_ = replica_placements(1, "cpu")
    assert list(whole.cpus) == cpus and threads >= 1
    if len(cpus) >= 2:
        shares = replica_placements(2, "cpu")
        assert not set(shares[0][0].cpus) & set(shares[1][0].cpus)
        assert sorted(shares[0][0].cpus + shares[1][0].cpus) == cpus
    with pytest.raises(ValueError, match="needs at least 1000 CPUs"):
        replica_placements(1000, "cpu")
    with pytest.raises(ValueError, match="at least 1"):
        replica_placements(0, "cpu")
