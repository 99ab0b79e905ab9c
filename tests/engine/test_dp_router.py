"""The data-parallel routing policy on plain records: under a steady mix of 8 adapters on 2
replicas, affinity routing loads each adapter on one replica and round robin on both; the
least-loaded fallback, the imbalance bound, unhealthy replicas skipped, prefix affinity (long
shared prefixes only, per adapter) and the bounded prefix map."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

import pytest

from loraplex.engine.dp_router import (
    AffinityRouter,
    ReplicaView,
    RoundRobinRouter,
    Router,
    make_router,
    prefix_chain,
)


@dataclass
class FakeReplica:
    healthy: bool = True
    inflight: int = 0
    adapters: set[str] = field(default_factory=set)
    loads: Counter[str] = field(default_factory=Counter)


def views(replicas: list[FakeReplica], lora: str | None) -> list[ReplicaView]:
    return [
        ReplicaView(i, r.healthy, r.inflight, lora is None or lora in r.adapters)
        for i, r in enumerate(replicas)
    ]


def steady_mix(router: Router, ticks: int = 400, num_adapters: int = 8) -> list[FakeReplica]:
    """One request per tick, each running 8 ticks; every adapter once per cycle of 8 requests,
    in a shuffled order (a strict ``i % 8`` would line up with round robin's ``i % 2``); a
    replica routed a request for an adapter it lacks loads it (as ``DataParallelClient``)."""
    rng = random.Random(0)
    order: list[int] = []
    for _ in range(ticks // num_adapters + 1):
        order += rng.sample(range(num_adapters), num_adapters)
    replicas = [FakeReplica(), FakeReplica()]
    running: list[tuple[int, int]] = []  # (ends at tick, replica)
    for tick in range(ticks):
        for end, i in [r for r in running if r[0] == tick]:
            replicas[i].inflight -= 1
            running.remove((end, i))
        lora = f"a{order[tick]}"
        prefix = prefix_chain([tick, tick + 1, tick + 2, tick + 3], 4, lora)
        i = router.choose(views(replicas, lora), prefix)
        assert i is not None
        if lora not in replicas[i].adapters:
            replicas[i].adapters.add(lora)
            replicas[i].loads[lora] += 1
        router.served(i, prefix)
        replicas[i].inflight += 1
        running.append((tick + 8, i))
    return replicas


def test_affinity_loads_each_adapter_on_one_replica_under_a_steady_mix() -> None:
    replicas = steady_mix(AffinityRouter())
    placed = Counter(key for r in replicas for key in r.loads)
    assert set(placed) == {f"a{k}" for k in range(8)}
    assert all(n == 1 for n in placed.values()), placed  # each adapter: one replica, once
    assert all(r.loads for r in replicas)  # both replicas serve
    assert abs(len(replicas[0].adapters) - len(replicas[1].adapters)) <= 2


def test_round_robin_loads_every_adapter_on_both_replicas() -> None:
    replicas = steady_mix(RoundRobinRouter())
    assert all(set(r.loads) == {f"a{k}" for k in range(8)} for r in replicas)


def test_base_and_unplaced_requests_go_to_the_least_loaded_replica() -> None:
    router = AffinityRouter()
    replicas = [FakeReplica(inflight=3), FakeReplica(inflight=1), FakeReplica(inflight=2)]
    assert router.choose(views(replicas, None), None) == 1
    assert router.choose(views(replicas, "nowhere"), None) == 1
    replicas[1].inflight = 3
    assert router.choose(views(replicas, None), None) == 2
    replicas[2].inflight = 3
    assert router.choose(views(replicas, None), None) == 0  # a tie: the lowest index


def test_an_adapter_stays_on_its_holder_until_the_imbalance_bound() -> None:
    router = AffinityRouter(spill_factor=2.0, spill_slack=4)
    holder, idle = FakeReplica(adapters={"hot"}), FakeReplica()
    for n in range(5):  # 0..4 in flight against 0: within 2 * 0 + 4
        holder.inflight = n
        assert router.choose(views([holder, idle], "hot"), None) == 0
    holder.inflight = 5
    assert router.choose(views([holder, idle], "hot"), None) == 1  # spills to the idle one
    assert router.spills == 1
    idle.inflight = 3  # 5 <= 2 * 3 + 4: back on the holder
    assert router.choose(views([holder, idle], "hot"), None) == 0
    holder.inflight, idle.inflight = 11, 3  # 11 > 10
    assert router.choose(views([holder, idle], "hot"), None) == 1
    both = [FakeReplica(inflight=6, adapters={"hot"}), FakeReplica(inflight=2, adapters={"hot"})]
    assert router.choose(views(both, "hot"), None) == 1  # two holders: the less loaded


def test_unhealthy_replicas_are_skipped() -> None:
    for router in (AffinityRouter(), RoundRobinRouter()):
        replicas = [FakeReplica(healthy=False, adapters={"a"}), FakeReplica(inflight=9)]
        assert [router.choose(views(replicas, "a"), None) for _ in range(3)] == [1, 1, 1]
        replicas[1].healthy = False
        assert router.choose(views(replicas, "a"), None) is None


def test_round_robin_cycles_over_the_healthy_replicas() -> None:
    router = RoundRobinRouter()
    replicas = [FakeReplica(), FakeReplica(), FakeReplica()]
    assert [router.choose(views(replicas, None), None) for _ in range(4)] == [0, 1, 2, 0]
    replicas[2].healthy = False
    assert [router.choose(views(replicas, None), None) for _ in range(3)] == [1, 0, 1]


def test_a_long_shared_prefix_returns_to_the_replica_that_served_it() -> None:
    router = AffinityRouter()
    replicas = [FakeReplica(), FakeReplica()]
    system = list(range(100, 164))  # 4 blocks of 16 shared by both prompts
    first = prefix_chain([*system, 1, 2, 3], 16)
    router.served(1, first)
    replicas[1].inflight = 3  # busier, within the bound: the cached prefix wins
    again = prefix_chain([*system, 7, 8, 9, 10], 16)
    assert router.choose(views(replicas, None), again) == 1
    # The same tokens on an adapter are another prefix (the engine never shares their KV).
    assert router.choose(views(replicas, None), prefix_chain([*system, 7], 16, "lora-x")) == 0
    # A short common start (a chat template's first block) does not pull a long prompt over.
    long_prompt = system[:16] + list(range(400, 500))
    assert router.choose(views(replicas, None), prefix_chain(long_prompt, 16)) == 0
    router.forget_replica(1)  # it restarted: its KV cache is empty
    assert router.choose(views(replicas, None), again) == 0


def test_the_prefix_map_is_bounded() -> None:
    router = AffinityRouter(map_size=8)
    for k in range(20):
        router.served(k % 2, prefix_chain([k] * 32, 16))
    assert len(router._owner) == 8
    short = prefix_chain([1, 2, 3], 16)
    assert short.hashes == () and prefix_chain(list(range(40)), 16).min_blocks() == 2


def test_policy_names_and_bad_settings() -> None:
    assert make_router("affinity").policy == "affinity"
    assert make_router("round_robin").policy == "round_robin"
    with pytest.raises(ValueError, match="affinity or round_robin"):
        make_router("random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spill_factor"):
        AffinityRouter(spill_factor=0.5)


@pytest.mark.parametrize(
    "module", ["loraplex.engine.dp_router", "loraplex.engine.dp_stats", "loraplex.engine.dp_client"]
)
def test_imports_no_torch(module: str) -> None:
    code = f"import sys, {module}; assert not any(m == 'torch' for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
