"""Scheduler with the KV manager and a torch-free fake runner (tests/utils/fake_runner.py).

The fake runner reads each request's context back through its block table, so these tests check
that chunked prefill, prefix hits, preemption, forks and aborts never corrupt or leak KV.
"""

from __future__ import annotations

import random
import time

import pytest

from loraplex.config import SchedulerConfig
from loraplex.engine.adapter_residency import AdapterResidency
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.records import EngineCoreOutput, RunnerOutput, TokenLogprobs
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.scheduler import Scheduler
from loraplex.sampling_params import SamplingParams
from tests.utils.fake_copier import FakeCopier
from tests.utils.fake_runner import FakeRunner, next_token, reference_generate


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_tokens: int = 32,
    max_model_len: int = 256,
    prefix_caching: bool = True,
) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_tokens), kv, max_model_len)
    return sched, FakeRunner(num_blocks, block_size)


def step(sched: Scheduler, runner: FakeRunner) -> list[EngineCoreOutput]:
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(out.requests) + len(out.forks) <= sched.config.max_num_seqs
    return sched.update(out, runner.execute(out))


def run_all(sched: Scheduler, runner: FakeRunner, limit: int = 10_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            break
        for o in step(sched, runner):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    assert not sched.has_unfinished_requests(), "requests left after the step limit"
    return tokens


def add(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int, **kw: object) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw))  # type: ignore[arg-type]
    sched.add_request(r)
    return r


def test_continuous_batching_matches_reference() -> None:
    sched, runner = make()
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(1000) for _ in range(rng.randint(1, 40))] for i in range(20)}
    lens = {rid: rng.randint(1, 20) for rid in prompts}
    for rid, p in prompts.items():
        add(sched, rid, p, lens[rid])
    got = run_all(sched, runner)
    for rid, p in prompts.items():
        assert got[rid] == reference_generate(p, lens[rid]), rid
    assert sched.kv.num_used_blocks == 0
    sched.kv.check_integrity()


def test_chunked_prefill_mixes_with_decodes() -> None:
    sched, runner = make(max_tokens=8)
    add(sched, "short", [1, 2, 3], 10)
    step(sched, runner)  # prefill of "short"
    add(sched, "long", list(range(30)), 2)
    out = sched.schedule()
    by_id = {s.request_id: s for s in out.requests}
    assert len(by_id["short"].token_ids) == 1  # a decode
    assert len(by_id["long"].token_ids) == 7  # a chunk filling the rest of the budget
    assert not by_id["long"].sample
    sched.update(out, runner.execute(out))
    got = run_all(sched, runner)
    assert got["long"] == reference_generate(list(range(30)), 2)


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    sched, runner = make(max_tokens=64)
    shared = list(range(40))
    add(sched, "a", [*shared, 1], 3)
    run_all(sched, runner)
    add(sched, "b", [*shared, 2], 3)
    out = sched.schedule()
    assert out.requests[0].start_pos == 40 and len(out.requests[0].token_ids) == 1
    sched.update(out, runner.execute(out))
    got = run_all(sched, runner)
    assert [*[], *got.get("b", [])]  # finished normally
    assert sched.kv.stats.prefix_hits == 40


def test_prefix_cache_off_recomputes() -> None:
    sched, runner = make(max_tokens=64, prefix_caching=False)
    add(sched, "a", list(range(40)), 1)
    run_all(sched, runner)
    add(sched, "b", list(range(40)), 1)
    out = sched.schedule()
    assert out.requests[0].start_pos == 0


def test_preemption_recomputes_and_finishes_everything() -> None:
    # 12 usable blocks of 4 tokens; 6 requests growing to 30 tokens each cannot all fit.
    sched, runner = make(num_blocks=13, max_num_seqs=6, max_tokens=64)
    prompts = {f"r{i}": [i + 1] * 10 for i in range(6)}
    for rid, p in prompts.items():
        add(sched, rid, p, 20)
    got = run_all(sched, runner)
    assert sched.stats.num_preemptions > 0
    for rid, p in prompts.items():
        assert got[rid] == reference_generate(p, 20)
    sched.kv.check_integrity()
    assert sched.kv.num_used_blocks == 0


def test_abort_anywhere_returns_blocks() -> None:
    sched, runner = make(max_tokens=8)
    add(sched, "running", list(range(5)), 50)
    add(sched, "chunking", list(range(30)), 5)
    add(sched, "waiting", list(range(30)), 5)
    step(sched, runner)
    step(sched, runner)
    sched.abort_requests(["chunking", "running", "waiting", "unknown"])
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_used_blocks == 0
    sched.kv.check_integrity()
    out = sched.schedule()
    assert set(out.finished_request_ids) == {"chunking", "running", "waiting"}


def test_stop_conditions() -> None:
    sched, runner = make()
    first = reference_generate([1, 2, 3], 5)
    r = Request(
        "eos", [1, 2, 3], SamplingParams(max_tokens=50), eos_token_ids=frozenset({first[2]})
    )
    sched.add_request(r)
    add(sched, "stopid", [1, 2, 3], 50, stop_token_ids=[first[1]])
    add(sched, "ignore", [1, 2, 3], 4, ignore_eos=True, stop_token_ids=[])
    outs: dict[str, EngineCoreOutput] = {}
    while sched.has_unfinished_requests():
        for o in step(sched, runner):
            if o.finish_reason:
                outs[o.request_id] = o
    assert r.output_token_ids == first[:3] and outs["eos"].finish_reason == "stop"
    assert outs["stopid"].stop_reason == first[1]
    assert outs["ignore"].finish_reason == "length"


def test_max_model_len_stops_with_length() -> None:
    sched, runner = make(max_model_len=12)
    add(sched, "a", list(range(10)), 100)
    outs = [o for _ in range(5) for o in step(sched, runner)]
    assert outs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outs) == 2


def test_prompt_that_cannot_fit_is_rejected() -> None:
    sched, _ = make(num_blocks=4)
    with pytest.raises(ValueError, match="does not fit"):
        add(sched, "huge", list(range(100)), 1)


def test_n_samples_fork_and_share_prompt_blocks() -> None:
    sched, runner = make(max_tokens=64)
    prompt = list(range(10))  # 2 full blocks + a partial one
    add(sched, "x-0", prompt, 6, seed=1)
    for i in (1, 2):
        r = Request(f"x-{i}", prompt, SamplingParams(max_tokens=6, seed=1 + i), parent_id="x-0")
        sched.add_request(r)
    out = sched.schedule()
    assert [f.request_id for f in out.forks] == ["x-1", "x-2"]
    tables = [sched.kv.block_table(f"x-{i}") for i in range(3)]
    assert tables[0] == tables[1] == tables[2]
    sched.update(out, runner.execute(out))
    out = sched.schedule()
    assert len(out.blocks_to_copy) == 2  # two of three copy the shared partial block
    sched.update(out, runner.execute(out))
    run_all(sched, runner)
    sched.kv.check_integrity()
    assert sched.kv.num_used_blocks == 0


def test_n_samples_outputs_match_independent_runs() -> None:
    prompt = list(range(10))
    sched, runner = make(max_tokens=64)
    reqs = [Request("x-0", prompt, SamplingParams(max_tokens=6, seed=1))]
    reqs += [
        Request(f"x-{i}", prompt, SamplingParams(max_tokens=6, seed=1 + i), parent_id="x-0")
        for i in (1, 2)
    ]
    for r in reqs:
        sched.add_request(r)
    run_all(sched, runner)
    for i, r in enumerate(reqs):
        assert r.output_token_ids == reference_generate(prompt, 6, seed=1 + i)


def test_random_operations_never_leak_blocks() -> None:
    """Thousands of random add / step / abort operations: no block leaks, outputs stay right."""
    rng = random.Random(1234)
    sched, runner = make(num_blocks=40, block_size=4, max_num_seqs=6, max_tokens=24)
    expected: dict[str, list[int]] = {}
    requests: dict[str, Request] = {}
    aborted: set[str] = set()
    start = time.perf_counter()
    shared = [rng.randrange(1000) for _ in range(12)]
    for op in range(4000):
        choice = rng.random()
        if choice < 0.15:
            rid = f"r{op}"
            prefix = shared if rng.random() < 0.5 else []
            prompt = prefix + [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
            n_out = rng.randint(1, 25)
            n = 3 if rng.random() < 0.1 else 1
            for i in range(n):
                sid = rid if i == 0 else f"{rid}-{i}"
                params = SamplingParams(max_tokens=n_out, seed=i)
                r = Request(sid, prompt, params, parent_id=rid if i else None)
                sched.add_request(r)
                requests[sid] = r
                expected[sid] = reference_generate(prompt, n_out, seed=i)
        elif choice < 0.2 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.abort_requests([victim])
            aborted.add(victim)
        else:
            step(sched, runner)
        if op % 97 == 0:
            sched.kv.check_integrity()
    run_all(sched, runner)
    sched.kv.check_integrity()
    assert sched.kv.num_used_blocks == 0
    assert sched.stats.num_preemptions > 0
    for rid, r in requests.items():
        if rid not in aborted:
            assert r.output_token_ids == expected[rid], rid
        else:
            assert r.output_token_ids == expected[rid][: len(r.output_token_ids)]
    assert time.perf_counter() - start < 10


def test_lora_slots_bound_adapters_per_step() -> None:
    kv = KVCacheManager(200, 4, True)
    sched = Scheduler(SchedulerConfig(16, 64), kv, 256, max_loras=2)
    runner = FakeRunner(200, 4)
    rng = random.Random(5)
    reqs = []
    for i in range(24):
        key = [None, "a", "b", "c", "d"][i % 5]
        r = Request(
            f"r{i}",
            [rng.randrange(1000) for _ in range(8)],
            SamplingParams(max_tokens=rng.randint(1, 12)),
            lora_key=key,
        )
        sched.add_request(r)
        reqs.append(r)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        keys = {sched.requests[s.request_id].lora_key for s in out.requests} - {None}
        assert len(keys) <= 2
        slots = {s.lora_slot for s in out.requests if s.lora_slot >= 0}
        assert slots <= {0, 1}
        for s in out.requests:
            key = sched.requests[s.request_id].lora_key
            assert (s.lora_slot == -1) == (key is None)
            if key is not None:
                assert out.lora_slots[s.lora_slot] == key
        sched.update(out, runner.execute(out))
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    assert sched.slots.in_use() == {}


def test_cold_adapter_is_not_starved() -> None:
    """A steady stream of hot-adapter requests cannot keep a cold adapter out forever."""
    kv = KVCacheManager(400, 4, True)
    sched = Scheduler(SchedulerConfig(8, 64), kv, 256, max_loras=1)
    runner = FakeRunner(400, 4)
    n = 0

    def add_hot() -> None:
        nonlocal n
        sched.add_request(
            Request(f"hot{n}", [n % 1000, 1, 2], SamplingParams(max_tokens=6), lora_key="hot")
        )
        n += 1

    for _ in range(4):
        add_hot()
    step(sched, runner)
    cold = Request("cold", [7, 7, 7], SamplingParams(max_tokens=3), lora_key="cold")
    sched.add_request(cold)
    steps = 0
    while cold.num_output_tokens == 0:
        add_hot()  # a new hot request arrives every step
        step(sched, runner)
        steps += 1
        assert steps < 16 + 6 + 4, "cold adapter starved"
    assert cold.lora_wait_steps >= 1


# ---- several tokens per request per step (speculative decoding, grammar rollback) -------------


def lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.5, 1, [(token, -0.5)])


def test_several_tokens_per_step_are_appended_and_computed_next_step() -> None:
    sched, _ = make()
    r = add(sched, "a", [1, 2, 3], 10, logprobs=1)
    out = sched.schedule()
    (o,) = sched.update(out, RunnerOutput({"a": [10, 11, 12]}, {"a": [lp(10), lp(11), lp(12)]}))
    assert o.new_token_ids == [10, 11, 12] and o.finish_reason is None
    assert o.new_logprobs is not None and [x.token_id for x in o.new_logprobs] == [10, 11, 12]
    assert o.queue_time is not None
    assert r.output_token_ids == [10, 11, 12] and r.num_computed_tokens == 3
    assert sched.stats.num_generated_tokens == 3
    out = sched.schedule()  # the three new tokens' KV is computed in one step
    (s,) = out.requests
    assert (s.start_pos, s.token_ids, s.sample) == (3, [10, 11, 12], True)
    (o,) = sched.update(out, RunnerOutput({"a": [13]}, {"a": [lp(13)]}))
    assert o.new_token_ids == [13] and o.queue_time is None


@pytest.mark.parametrize(
    ("kw", "eos", "reason", "stop_reason"),
    [
        (dict(stop_token_ids=[11]), frozenset(), "stop", 11),
        (dict(), frozenset({11}), "stop", None),
        (dict(max_tokens=2), frozenset(), "length", None),
    ],
)
def test_a_token_that_ends_the_request_drops_the_ones_after_it(
    kw: dict[str, object], eos: frozenset[int], reason: str, stop_reason: int | None
) -> None:
    sched, _ = make()
    params = SamplingParams(**{"max_tokens": 10, "logprobs": 0, **kw})  # type: ignore[arg-type]
    r = Request("a", [1, 2, 3], params, eos_token_ids=eos)
    sched.add_request(r)
    out = sched.schedule()
    (o,) = sched.update(out, RunnerOutput({"a": [10, 11, 12]}, {"a": [lp(10), lp(11), lp(12)]}))
    assert o.new_token_ids == [10, 11] and r.output_token_ids == [10, 11]
    assert o.new_logprobs is not None and len(o.new_logprobs) == 2
    assert (o.finish_reason, o.stop_reason) == (reason, stop_reason)
    assert sched.stats.num_generated_tokens == 2
    assert not sched.has_unfinished_requests() and sched.kv.num_used_blocks == 0


def test_max_model_len_in_the_middle_of_a_step() -> None:
    sched, _ = make(max_model_len=5)
    r = add(sched, "a", [1, 2, 3], 10)
    out = sched.schedule()
    (o,) = sched.update(out, RunnerOutput({"a": [10, 11, 12]}))
    assert o.new_token_ids == [10, 11] and o.finish_reason == "length" and r.num_tokens == 5


@pytest.mark.parametrize("k", [2, 3])
def test_multi_token_steps_match_reference_under_preemption_and_forks(k: int) -> None:
    rng = random.Random(k)
    sched, _ = make(num_blocks=16, max_num_seqs=6, max_tokens=24)
    runner = FakeRunner(16, 4, tokens_per_step=k)
    reqs: list[Request] = []
    for i in range(30):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
        n_out = rng.randint(1, 20)
        n = 2 if i % 7 == 0 else 1
        for j in range(n):
            params = SamplingParams(max_tokens=n_out, seed=j)
            r = Request(f"r{i}-{j}", prompt, params, parent_id=f"r{i}-0" if j else None)
            sched.add_request(r)
            reqs.append(r)
    got = run_all(sched, runner)
    assert sched.stats.num_preemptions > 0
    for r in reqs:
        want = reference_generate(r.prompt_token_ids, r.params.max_tokens or 0, r.params.seed or 0)
        assert got[r.request_id] == want == r.output_token_ids, r.request_id
    sched.kv.check_integrity()
    assert sched.kv.num_used_blocks == 0


# ---- rollback -----------------------------------------------------------------------------------


def test_rollback_recomputes_the_last_kept_token_and_continues() -> None:
    sched, runner = make()
    prompt = [1, 2, 3, 4, 5]
    r = add(sched, "a", prompt, 8)
    for _ in range(6):
        step(sched, runner)
    want = reference_generate(prompt, 8)
    assert r.output_token_ids == want[:6]
    table = sched.kv.block_table("a")
    sched.rollback("a", len(prompt) + 2)  # keep two generated tokens
    assert r.output_token_ids == want[:2] and r.num_computed_tokens == len(prompt) + 1
    assert len(table) == 2  # 6 KV tokens in blocks of 4; the same list the records hold
    out = sched.schedule()
    (s,) = out.requests
    assert (s.start_pos, s.token_ids) == (len(prompt) + 1, [want[1]])
    sched.update(out, runner.execute(out))
    run_all(sched, runner)
    assert r.output_token_ids == want
    sched.kv.check_integrity()
    assert sched.kv.num_used_blocks == 0


def test_rollback_refuses_the_prompt_and_unknown_requests() -> None:
    sched, runner = make()
    add(sched, "a", [1, 2, 3], 8)
    step(sched, runner)
    with pytest.raises(ValueError, match="cannot truncate to 2 tokens"):
        sched.rollback("a", 2)
    with pytest.raises(ValueError, match="not in the engine"):
        sched.rollback("zzz", 3)
    sched.rollback("a", 3)  # back to the prompt alone: it samples its first token again
    assert sched.requests["a"].num_output_tokens == 0


def test_random_rollbacks_with_forced_tokens_keep_the_kv_right() -> None:
    """Rollbacks to random points, each followed by a forced token (a grammar's choice), among
    prefix-cache hits, forks and preemption: the fake runner checks every step that the KV read
    back through the block tables is the request's tokens, so a stale hash would fail it."""
    rng = random.Random(11)
    sched, _ = make(num_blocks=24, max_num_seqs=6, max_tokens=24)
    runner = FakeRunner(24, 4)
    forced_at: dict[str, dict[int, int]] = {}  # request id -> position -> forced token
    reqs: dict[str, Request] = {}
    shared = [rng.randrange(1000) for _ in range(9)]
    history: list[list[int]] = [shared]  # token sequences before a rollback: new prompts reuse
    rollbacks = 0
    for op in range(3000):
        if op % 9 == 0:
            rid = f"r{op}"
            old = rng.choice(history)
            prompt = [*old[: rng.randint(1, len(old))], rng.randrange(1000)]
            n = 2 if op % 5 == 0 else 1
            for j in range(n):
                sid = rid if j == 0 else f"{rid}-{j}"
                params = SamplingParams(max_tokens=rng.randint(4, 20), seed=j)
                reqs[sid] = Request(sid, prompt, params, parent_id=rid if j else None)
                sched.add_request(reqs[sid])
                forced_at[sid] = {}
        live = [r for r in sched.requests.values() if r.num_output_tokens > 1]
        if live and rng.random() < 0.15:
            r = rng.choice(live)
            keep = rng.randint(r.num_prompt_tokens + 1, r.num_tokens - 1)
            history.append(list(r.all_token_ids))
            sched.rollback(r.request_id, keep)
            forced_at[r.request_id] = {p: t for p, t in forced_at[r.request_id].items() if p < keep}
            forced = rng.randrange(1000)
            runner.forced[r.request_id] = forced
            forced_at[r.request_id][keep] = forced
            rollbacks += 1
        step(sched, runner)
        if op % 50 == 0:
            sched.kv.check_integrity()
    run_all(sched, runner)
    assert rollbacks > 100 and sched.stats.num_preemptions > 0 and sched.kv.stats.prefix_hits
    sched.kv.check_integrity()
    assert sched.kv.num_used_blocks == 0
    for sid, r in reqs.items():
        assert r.num_output_tokens == r.params.max_tokens
        tokens = list(r.prompt_token_ids)
        for t in r.output_token_ids:
            forced = forced_at[sid].get(len(tokens))
            assert t == (forced if forced is not None else next_token(tokens, r.params.seed or 0))
            tokens.append(t)


def test_requests_wait_for_their_adapter_to_be_resident_while_others_run() -> None:
    kv = KVCacheManager(200, 4, True)
    residency = AdapterResidency({"q_proj": 8}, max_cpu_loras=4, max_loras=4)
    residency.register("a", "a", {"q_proj": 4}, 1000)
    sched = Scheduler(SchedulerConfig(16, 64), kv, 256, max_loras=4, residency=residency)
    runner = FakeCopier(FakeRunner(200, 4), delay=3)
    base = Request("base", [1, 2, 3], SamplingParams(max_tokens=6))
    cold = Request("cold", [4, 5, 6], SamplingParams(max_tokens=2), lora_key="a")
    sched.add_request(base)
    sched.add_request(cold)
    steps_before_cold: list[set[str]] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        ids = {s.request_id for s in out.requests}
        if "cold" not in ids and cold.status == RequestStatus.WAITING:
            steps_before_cold.append(ids)
        sched.update(out, runner.execute(out))
    # The base request ran while the adapter loaded; the adapter request ran once resident.
    assert len(steps_before_cold) >= 3 and all(ids == {"base"} for ids in steps_before_cold)
    assert cold.num_output_tokens == 2 and base.num_output_tokens == 6
    assert runner.loads == ["a"] and residency.tier_of("a") == "device"
