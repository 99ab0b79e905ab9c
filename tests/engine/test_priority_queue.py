"""The "priority" policy alone (lower priority first, FCFS within a priority, the victims it names)
and in the scheduler with the fake runner: priority preemption for a seat and for KV room, never
in vain and never back, and thousands of random steps that all finish with the right tokens."""

from __future__ import annotations

import random

import pytest

from loraplex.config import SchedulerConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.priority_queue import PriorityQueue
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.waiting_queue import WaitingQueue, make_waiting_queue
from loraplex.sampling_params import SamplingParams
from tests.utils.fake_runner import FakeRunner, reference_generate


def req(
    rid: str, priority: int = 0, lora_key: str | None = None, prompt: int = 3, max_tokens: int = 4
) -> Request:
    seed = sum(map(ord, rid)) * 31
    return Request(
        rid,
        [(seed + 7 * i) % 1000 for i in range(prompt)],  # no shared prefixes between ids
        SamplingParams(max_tokens=max_tokens),
        lora_key=lora_key,
        priority=priority,
    )


def admit_all(queue: WaitingQueue, ready: set[str]) -> list[str]:
    admitted = []
    queue.begin_admission(lambda key: key in ready)
    while (r := queue.peek()) is not None:
        assert queue.pop() is r
        admitted.append(r.request_id)
    queue.end_admission()
    return admitted


def test_lower_priority_first_fcfs_within_and_preempted_first_in_its_priority() -> None:
    q = PriorityQueue()
    for rid, prio in (("a", 1), ("b", 0), ("c", 1), ("d", -1), ("e", 0)):
        q.add(req(rid, prio))
    q.prepend(req("back", 1))  # preempted
    assert [r.request_id for r in q] == ["d", "b", "e", "back", "a", "c"] and len(q) == 6
    assert admit_all(q, set()) == ["d", "b", "e", "back", "a", "c"]
    assert isinstance(make_waiting_queue("priority"), PriorityQueue)


def test_cold_adapter_is_passed_over_keeps_its_place_and_starves_only_its_priority() -> None:
    q = PriorityQueue(lora_starvation_steps=2)
    cold = req("cold", 1, "x")
    q.add(cold)
    for i in range(2):
        q.add(req(f"hot{i}", 1, "h"))
        assert admit_all(q, {"h"}) == [f"hot{i}"]
    assert cold.lora_wait_steps == 2  # starving from now on
    q.add(req("hot-same", 1, "h"))
    q.add(req("hot-better", 0, "h"))
    q.add(req("base", 1))
    # A better priority still passes; its own priority's adapter requests wait; base passes.
    assert admit_all(q, {"h"}) == ["hot-better", "base"]
    assert [r.request_id for r in q] == ["cold", "hot-same"]
    assert admit_all(q, {"h", "x"}) == ["cold"]


def test_victims_worst_priority_then_newest_and_only_strictly_worse_for_admission() -> None:
    q = PriorityQueue()
    running = [req("p1-old", 1), req("p2", 2), req("p0", 0), req("p1-new", 1)]
    assert q.preemption_victim(running, 0) == 1
    assert q.preemption_victim(running, 2) == 3  # among those not yet scheduled
    victims = q.admission_victims(running, req("w", 0))
    assert [v.request_id for v in victims] == ["p2", "p1-new", "p1-old"]
    assert q.admission_victims(running, req("w", 2)) == []  # nobody is worse than 2


# ---- in the scheduler --------------------------------------------------------------------------


def make(num_blocks: int = 64, max_num_seqs: int = 2, budget: int = 32) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4)
    config = SchedulerConfig(max_num_seqs, budget, scheduling_policy="priority")
    return Scheduler(config, kv, 256)


def step(sched: Scheduler, runner: FakeRunner) -> set[str]:
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    sched.kv.check_integrity()
    return {s.request_id for s in out.requests}


def test_a_better_request_gets_a_seat_from_the_worst_newest_running_one() -> None:
    sched = make(max_num_seqs=2)
    runner = FakeRunner(64, 4)
    low, worse = req("low", 1, max_tokens=50), req("worse", 2, max_tokens=50)
    for r in (low, worse):
        sched.add_request(r)
    step(sched, runner)
    high = req("high", 0, max_tokens=3)
    sched.add_request(high)
    assert step(sched, runner) == {"low", "worse"}  # no seat: "worse" is marked
    assert step(sched, runner) == {"low", "high"}  # preempted before the step; high admitted
    assert worse.status == RequestStatus.WAITING and worse.num_preemptions == 1
    assert low.num_preemptions == 0
    while sched.has_unfinished_requests():
        step(sched, runner)
    for r in (low, worse, high):
        assert r.output_token_ids == reference_generate(r.prompt_token_ids, r.params.max_tokens)


def test_equal_priority_waits_for_a_seat() -> None:
    sched = make(max_num_seqs=1)
    runner = FakeRunner(64, 4)
    sched.add_request(req("first", 0, max_tokens=6))
    step(sched, runner)
    sched.add_request(req("second", 0, max_tokens=2))
    for _ in range(5):
        assert step(sched, runner) == {"first"}
    assert sched.stats.num_preemptions == 0


def test_kv_room_is_made_with_enough_victims_and_never_in_vain() -> None:
    # 16 usable blocks of 4 tokens; four p1 requests of 12 tokens hold 12 of them.
    sched = make(num_blocks=17, max_num_seqs=8, budget=64)
    runner = FakeRunner(17, 4)
    lows = [req(f"low{i}", 1, prompt=11, max_tokens=30) for i in range(4)]
    for r in lows:
        sched.add_request(r)
    step(sched, runner)
    assert sched.kv.num_free_blocks == 4
    high = req("high", 0, prompt=32, max_tokens=2)  # 8 blocks: 4 short; one victim frees 3
    sched.add_request(high)
    step(sched, runner)
    assert [v.request_id for v, _ in sched._to_preempt] == ["low3", "low2"]
    assert "high" in step(sched, runner)
    assert [r.num_preemptions for r in lows] == [0, 0, 1, 1]

    # All worse requests together cannot make room: nobody is preempted for nothing.
    sched = make(num_blocks=17, max_num_seqs=8, budget=64)
    sched.add_request(req("keep", 0, prompt=40, max_tokens=30))  # holds 11 blocks at priority 0
    sched.add_request(req("low", 1, prompt=7, max_tokens=30))  # holds 2
    runner = FakeRunner(17, 4)
    step(sched, runner)
    sched.add_request(req("high", 0, prompt=28, max_tokens=2))  # needs 8; 3 free + 2 at most
    for _ in range(3):
        assert "high" not in step(sched, runner)
    assert sched.stats.num_preemptions == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_random_priorities_thousands_of_steps_finish_right_and_never_preempt_back(
    seed: int,
) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(40, 4)
    sched = Scheduler(SchedulerConfig(4, 24, scheduling_policy="priority"), kv, 256)
    runner = FakeRunner(40, 4)
    reqs: list[Request] = []
    made_room: set[tuple[str, str]] = set()  # (victim, the request it made room for)
    for n in range(3000):
        if rng.random() < 0.3:
            r = req(f"r{n}", rng.randint(-1, 2), None, rng.randint(1, 24), rng.randint(1, 20))
            sched.add_request(r)
            reqs.append(r)
        step(sched, runner)
        for victim, beneficiary in sched._to_preempt:
            assert victim.priority > beneficiary.priority
            assert (beneficiary.request_id, victim.request_id) not in made_room
            made_room.add((victim.request_id, beneficiary.request_id))
    while sched.has_unfinished_requests():
        step(sched, runner)
        assert runner.steps < 10_000, "livelock: requests left"
    assert made_room and sched.stats.num_preemptions < len(reqs)
    for r in reqs:
        assert r.output_token_ids == reference_generate(r.prompt_token_ids, r.params.max_tokens)
    assert kv.num_used_blocks == 0
