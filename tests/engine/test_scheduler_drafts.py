"""The scheduler with draft tokens (speculative decoding), on the torch-free fake runner, which
verifies drafts as the real runner does and reads every context back through the block tables:
drafts are scheduled only for decodes within the budget, rejected drafts' KV is trimmed (blocks
freed), their blocks never enter the prefix cache, and under preemption, forks and prefix hits
every request still gets the tokens it gets without drafts."""

from __future__ import annotations

import random

from loraplex.config import SchedulerConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import Request
from loraplex.engine.scheduler import Scheduler
from loraplex.sampling_params import SamplingParams
from tests.utils.fake_runner import FakeRunner, reference_generate


def make(
    num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 32
) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size, True)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget), kv, 256)
    return sched, FakeRunner(num_blocks, block_size)


def test_drafts_go_with_a_decode_and_rejected_ones_are_trimmed() -> None:
    sched, runner = make()
    prompt = [5, 6, 7]
    want = reference_generate(prompt, 12)
    r = Request("a", prompt, SamplingParams(max_tokens=12))
    sched.add_request(r)
    r.draft_token_ids = [1, 2]  # not a decode yet (waiting, prefill): ignored
    out = sched.schedule()
    assert out.requests[0].draft_token_ids == [] and out.requests[0].token_ids == prompt
    sched.update(out, runner.execute(out))  # first token; 4 tokens: one block
    # two right drafts, then two wrong ones: 2 accepted, the third token the model's
    r.draft_token_ids = [want[1], want[2], 999, 998]
    out = sched.schedule()
    (s,) = out.requests
    assert s.token_ids == [want[0], want[1], want[2], 999, 998] and s.sample
    assert out.num_batched_tokens == 5
    assert len(sched.kv.block_table("a")) == 2  # room for 8 tokens: all the drafts
    (o,) = sched.update(out, runner.execute(out))
    assert o.new_token_ids == want[1:4]
    assert r.output_token_ids == want[:4] and r.num_computed_tokens == r.num_tokens - 1 == 6
    assert len(sched.kv.block_table("a")) == 2  # 6 tokens of KV: the second block is kept
    r.draft_token_ids = [997]  # rejected at once: one token, and KV for 7 tokens
    out = sched.schedule()
    (o,) = sched.update(out, runner.execute(out))
    assert o.new_token_ids == [want[4]] and r.num_computed_tokens == 7
    sched.kv.check_integrity()


def test_rejected_drafts_free_their_blocks_and_never_enter_the_prefix_cache() -> None:
    sched, runner = make(block_size=2)
    prompt = [5, 6, 7]
    want = reference_generate(prompt, 10)
    r = Request("a", prompt, SamplingParams(max_tokens=10))
    sched.add_request(r)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    cached = sched.kv.num_cached_blocks
    r.draft_token_ids = [900, 901, 902, 903, 904, 905]  # all wrong: 3 more blocks for them
    out = sched.schedule()
    assert len(sched.kv.block_table("a")) == 5
    used = sched.kv.num_used_blocks
    sched.update(out, runner.execute(out))
    # 5 tokens known, KV for 4 of them: two blocks, the three of the drafts back in the pool
    assert len(sched.kv.block_table("a")) == 2 and sched.kv.num_used_blocks == used - 3
    # the block of the 4 known tokens is registered (computed this step); no draft block is
    assert sched.kv.num_cached_blocks == cached + 1
    assert r.output_token_ids == want[:2]
    sched.kv.check_integrity()


def test_drafts_fit_the_budget_and_are_dropped_before_anyone_is_preempted() -> None:
    sched, runner = make(budget=4)
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=30))
    sched.add_request(r)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    r.draft_token_ids = [7] * 8
    out = sched.schedule()
    assert out.requests[0].draft_token_ids == [7] * 3  # the budget: 4 tokens, 1 is the decode

    sched, runner = make(num_blocks=4, block_size=4, budget=16)  # 3 usable blocks of 4
    b = Request("b", list(range(10, 17)), SamplingParams(max_tokens=20))
    a = Request("a", [1, 2], SamplingParams(max_tokens=20))
    sched.add_request(b)
    sched.add_request(a)
    out = sched.schedule()  # b takes two blocks, a the third
    sched.update(out, runner.execute(out))
    a.draft_token_ids = [7, 7, 7]  # positions 3..5: a second block for a, and none is free
    out = sched.schedule()
    assert [(s.request_id, s.draft_token_ids) for s in out.requests] == [("b", []), ("a", [])]
    sched.update(out, runner.execute(out))
    assert sched.stats.num_preemptions == 0
    sched.kv.check_integrity()


def test_random_drafts_keep_every_output_and_the_kv_right() -> None:
    """Random drafts (right, partly right, wrong) on a small pool with prefix hits, forks and
    preemptions: every request's tokens are those it gets alone, and no block leaks."""
    rng = random.Random(3)
    sched, runner = make(num_blocks=20, block_size=4, max_num_seqs=6, budget=24)
    shared = [rng.randrange(1000) for _ in range(9)]
    reqs: list[Request] = []
    for i in range(30):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1000) for _ in range(1, 12)]
        n_out = rng.randint(1, 24)
        n = 2 if i % 5 == 0 else 1
        for j in range(n):
            params = SamplingParams(max_tokens=n_out, seed=j)
            r = Request(f"r{i}-{j}", prompt, params, parent_id=f"r{i}-0" if j else None)
            sched.add_request(r)
            reqs.append(r)
    wants = {
        r.request_id: reference_generate(r.prompt_token_ids, 64, r.params.seed or 0) for r in reqs
    }
    got: dict[str, list[int]] = {}
    drafted = accepted_any = 0
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            break
        for r in sched.running:
            if r.num_output_tokens and r.num_computed_tokens == r.num_tokens - 1:
                want = wants[r.request_id][r.num_output_tokens :]
                k = rng.randint(0, 5)
                good = rng.randint(0, k)
                r.draft_token_ids = want[:good] + [rng.randrange(1000) for _ in range(k - good)]
        out = sched.schedule()
        drafted += sum(len(s.draft_token_ids) for s in out.requests)
        result = runner.execute(out)
        accepted_any += sum(len(t) > 1 for t in result.sampled.values())
        for o in sched.update(out, result):
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        sched.kv.check_integrity()
    assert not sched.has_unfinished_requests()
    assert drafted > 200 and accepted_any > 50
    assert sched.stats.num_preemptions > 0 and sched.kv.stats.prefix_hits > 0
    for r in reqs:
        n = r.params.max_tokens or 0
        assert got[r.request_id] == wants[r.request_id][:n] == r.output_token_ids, r.request_id
    assert sched.kv.num_used_blocks == 0
