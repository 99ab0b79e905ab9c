"""The scheduling policy alone (``FCFSQueue``) and injected into the scheduler with the fake
runner: admission order, passing over adapters without a slot, the starvation bound, the
preemption victim, and a policy that breaks the protocol; the selector builds every policy
(``PriorityQueue`` and ``FairQueue`` have their own tests)."""

from __future__ import annotations

import random

import pytest

from loraplex.config import SchedulerConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import Request
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.waiting_queue import (
    LORA_STARVATION_STEPS,
    FairQueue,
    FCFSQueue,
    PriorityQueue,
    WaitingQueue,
    make_waiting_queue,
)
from loraplex.sampling_params import SamplingParams
from tests.utils.fake_runner import FakeRunner, reference_generate


def req(rid: str, lora_key: str | None = None, max_tokens: int = 4) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens), lora_key=lora_key)


def ids(queue: WaitingQueue) -> list[str]:
    return [r.request_id for r in queue]


def admit_all(queue: WaitingQueue, ready: set[str]) -> list[str]:
    """One admission pass that admits everything the policy offers."""
    admitted = []
    queue.begin_admission(lambda key: key in ready)
    while (r := queue.peek()) is not None:
        assert queue.pop() is r
        admitted.append(r.request_id)
    queue.end_admission()
    return admitted


def test_fcfs_order_prepend_and_remove() -> None:
    q = FCFSQueue()
    a, b, c, d = (req(x) for x in "abcd")
    for r in (a, b, c):
        q.add(r)
    q.prepend(d)
    assert ids(q) == ["d", "a", "b", "c"] and len(q) == 4
    assert q.remove(b) and not q.remove(b)
    assert not q.remove(req("a"))  # an equal request that is not queued: identity counts
    assert admit_all(q, set()) == ["d", "a", "c"]
    assert len(q) == 0


def test_a_request_that_is_not_popped_keeps_its_place() -> None:
    q = FCFSQueue()
    for x in "abc":
        q.add(req(x))
    q.begin_admission(lambda key: True)
    head = q.peek()
    assert head is not None and head.request_id == "a"
    q.end_admission()  # e.g. its blocks did not fit
    assert ids(q) == ["a", "b", "c"]


def test_adapter_without_a_slot_is_passed_over_and_keeps_its_place() -> None:
    q = FCFSQueue()
    for r in (req("cold", "x"), req("base"), req("hot", "h"), req("cold2", "x")):
        q.add(r)
    q.begin_admission(lambda key: key == "h")
    first = q.peek()
    assert first is not None and first.request_id == "base"
    assert ids(q) == ["cold", "base", "hot", "cold2"] and len(q) == 4  # during the pass too
    q.pop()
    second = q.peek()
    assert second is not None and second.request_id == "hot"
    q.pop()
    assert q.peek() is None
    q.end_admission()
    assert ids(q) == ["cold", "cold2"]
    assert [r.lora_wait_steps for r in q] == [1, 1]


def test_starving_request_stops_other_adapters_from_passing_it() -> None:
    q = FCFSQueue(lora_starvation_steps=3)
    cold = req("cold", "x")
    q.add(cold)
    for i in range(3):
        q.add(req(f"hot{i}", "h"))
    assert admit_all(q, {"h"}) == ["hot0", "hot1", "hot2"]
    for i in range(2):
        q.add(req(f"hot{i + 3}", "h"))
        assert admit_all(q, {"h"}) == [f"hot{i + 3}"]
    assert cold.lora_wait_steps == 3  # starving from the next pass on
    q.add(req("hot9", "h"))
    q.add(req("base"))
    assert admit_all(q, {"h"}) == ["base"]  # base requests still pass; adapter ones wait
    assert ids(q) == ["cold", "hot9"]
    # Its slot came free. Starvation is judged once per pass: hot9 waits one more step.
    assert admit_all(q, {"h", "x"}) == ["cold"]
    assert admit_all(q, {"h", "x"}) == ["hot9"]


def test_passes_must_not_nest() -> None:
    q = FCFSQueue()
    with pytest.raises(RuntimeError, match="begin_admission"):
        q.peek()
    q.begin_admission(lambda key: True)
    with pytest.raises(RuntimeError, match="already open"):
        q.begin_admission(lambda key: True)


def test_fcfs_victim_is_the_newest_running_request() -> None:
    running = [req(x) for x in "abc"]
    assert FCFSQueue().preemption_victim(running, 0) == 2
    assert FCFSQueue().preemption_victim(running, 2) == 2


def test_policy_selector_and_config() -> None:
    assert isinstance(make_waiting_queue("fcfs"), FCFSQueue)
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_waiting_queue("lottery")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lottery")  # type: ignore[arg-type]
    kv = KVCacheManager(8, 4)
    assert isinstance(Scheduler(SchedulerConfig(), kv, 16).waiting, FCFSQueue)
    mine = FCFSQueue()
    assert Scheduler(SchedulerConfig(), kv, 16, waiting_queue=mine).waiting is mine


# ---- injected into the scheduler ---------------------------------------------------------------


class PreemptNeedy(FCFSQueue):
    """Preempts the request that needs the room itself (not the newest)."""

    def __init__(self) -> None:
        super().__init__()
        self.choices: list[tuple[int, int]] = []

    def preemption_victim(self, running: list[Request], first: int) -> int:
        self.choices.append((first, len(running)))
        return first


def run_preempting(queue: WaitingQueue) -> Scheduler:
    kv = KVCacheManager(13, 4)  # 12 usable blocks: 6 requests of 30 tokens cannot all fit
    sched = Scheduler(SchedulerConfig(6, 64), kv, 256, waiting_queue=queue)
    runner = FakeRunner(13, 4)
    reqs = [Request(f"r{i}", [i + 1] * 10, SamplingParams(max_tokens=20)) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        kv.check_integrity()
    for r in reqs:  # nothing lost, nothing corrupted, whoever was preempted
        assert r.output_token_ids == reference_generate(r.prompt_token_ids, 20)
    assert kv.num_used_blocks == 0
    return sched


def test_scheduler_asks_the_policy_for_the_victim() -> None:
    policy = PreemptNeedy()
    sched = run_preempting(policy)
    assert sched.stats.num_preemptions == len(policy.choices) > 0
    assert all(0 <= first < n for first, n in policy.choices)
    fcfs = run_preempting(FCFSQueue())
    assert fcfs.stats.num_preemptions > 0


class ScheduledVictim(FCFSQueue):
    def preemption_victim(self, running: list[Request], first: int) -> int:
        return first - 1  # already scheduled this step: not allowed


def test_a_victim_already_scheduled_is_refused() -> None:
    with pytest.raises(RuntimeError, match="not yet scheduled"):
        run_preempting(ScheduledVictim())


@pytest.mark.parametrize("limit", [LORA_STARVATION_STEPS, 10**9])
def test_thousands_of_steps_with_a_steady_hot_stream(limit: int) -> None:
    """A hot adapter request arrives every step and one slot exists: each cold request is served
    within a bounded wait with the starvation rule, and never without it."""
    rng = random.Random(7)
    kv = KVCacheManager(600, 4)
    sched = Scheduler(SchedulerConfig(8, 64), kv, 256, max_loras=1, waiting_queue=FCFSQueue(limit))
    runner = FakeRunner(600, 4)
    added: dict[str, int] = {}
    first_token: dict[str, int] = {}
    for n in range(3000):
        sched.add_request(
            Request(f"hot{n}", [n % 1000, 1], SamplingParams(max_tokens=4), lora_key="hot")
        )
        added[f"hot{n}"] = n
        if n % 300 == 10:
            sched.add_request(
                Request(
                    f"cold{n}",
                    [rng.randrange(1000)],
                    SamplingParams(max_tokens=2),
                    lora_key=f"c{n}",
                )
            )
            added[f"cold{n}"] = n
        out = sched.schedule()
        for o in sched.update(out, runner.execute(out)):
            first_token.setdefault(o.request_id, n)
    colds = [rid for rid in added if rid.startswith("cold")]
    assert len(colds) == 10
    waits = [first_token.get(rid, 3000) - added[rid] for rid in colds]
    if limit == LORA_STARVATION_STEPS:
        assert max(waits) <= limit + 8, waits
    else:  # the hot adapter holds the only slot for good
        assert not any(rid in first_token for rid in colds), waits
    kv.check_integrity()


def test_every_policy_from_the_config() -> None:
    fair = make_waiting_queue("fair", SchedulerConfig(fair_prompt_weight=0, fair_output_weight=3))
    assert isinstance(fair, FairQueue) and (fair.prompt_weight, fair.output_weight) == (0, 3)
    assert isinstance(make_waiting_queue("priority"), PriorityQueue)
    kv = KVCacheManager(8, 4)
    sched = Scheduler(SchedulerConfig(scheduling_policy="fair"), kv, 16)
    assert isinstance(sched.waiting, FairQueue)
    assert (sched.waiting.prompt_weight, sched.waiting.output_weight) == (1.0, 2.0)
    with pytest.raises(ValueError, match="fair_output_weight must be"):
        SchedulerConfig(fair_output_weight=-1)
    with pytest.raises(ValueError, match="both 0"):
        SchedulerConfig(fair_prompt_weight=0, fair_output_weight=0)
    with pytest.raises(ValueError, match="one of fcfs, priority, fair"):
        SchedulerConfig(scheduling_policy="lottery")  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_new_slots_go_in_arrival_order(policy: str) -> None:
    """An earlier adapter request passed over (its adapter still loading) is not overtaken for
    a new slot by a later request on another cold adapter; a request whose adapter holds a slot
    and a base request still pass it."""
    from loraplex.engine.waiting_queue import make_waiting_queue

    q = make_waiting_queue(policy)  # type: ignore[arg-type]
    reqs = [
        Request("b", [1], SamplingParams(max_tokens=1), lora_key="loading"),
        Request("a1", [1], SamplingParams(max_tokens=1), lora_key="other"),
        Request("a2", [1], SamplingParams(max_tokens=1), lora_key="hot"),
        Request("base", [1], SamplingParams(max_tokens=1)),
    ]
    for r in reqs:
        q.add(r)
    q.begin_admission(lambda key: key != "loading", lambda key: key == "hot")
    admitted = []
    while (r := q.peek()) is not None:
        assert q.pop() is r
        admitted.append(r.request_id)
    q.end_admission()
    assert admitted == ["a2", "base"]
    # without the slot view (a pass opened alone), the cold request is overtaken as before
    q.begin_admission(lambda key: key != "loading")
    assert q.peek() is reqs[1]
    q.end_admission()
