"""Draft lengths follow each request's acceptance and the batch's row cost; a large batch turns
speculation off."""

from __future__ import annotations

from loraplex.engine.spec.policy import PROBE_EVERY, DraftPolicy, device_costs


def test_acceptance_raises_and_lowers_the_draft_length_per_request() -> None:
    policy = DraftPolicy(max_drafts=4, disable_by_batch_size=8)
    assert policy.num_drafts("a") == 4  # the prior at batch 1: 0.6 ** 4 >= 0.05
    for _ in range(10):
        policy.observe("a", 4, 4)
        policy.observe("b", 4, 0)
        policy.observe("c", 4, 1)  # beta near 0.5
    assert policy.num_drafts("a") == 4
    assert policy.num_drafts("b") == 0
    assert policy.num_drafts("c") == 4  # 0.5 ** 4 >= 0.05 at batch 1 ...
    assert policy.num_drafts("c", num_decoding=4) == 2  # ... but a row costs 0.2 at batch 4


def test_larger_batches_cost_more_per_row() -> None:
    cpu = device_costs("cpu")
    assert cpu.row_cost(1) == 0.05 and cpu.row_cost(8) == 0.4 and cpu.row_cost(64) == 0.7
    assert device_costs("mps") == cpu and device_costs("cuda").row_cost(32) <= 0.1
    policy = DraftPolicy(max_drafts=4, disable_by_batch_size=16)
    for _ in range(20):
        policy.observe("copy", 4, 4)  # beta close to 1
    assert [policy.num_drafts("fresh", b) for b in (1, 8, 16)] == [4, 1, 0]
    assert [policy.num_drafts("copy", b) for b in (1, 8, 16)] == [4, 4, 4]


def test_a_request_at_zero_drafts_is_probed_again() -> None:
    policy = DraftPolicy(max_drafts=4, disable_by_batch_size=8)
    for _ in range(20):
        policy.observe("b", 4, 0)
    asks = [policy.num_drafts("b") for _ in range(PROBE_EVERY * 2)]
    assert asks.count(1) == 2 and asks.count(0) == PROBE_EVERY * 2 - 2
    for _ in range(6):  # the probes come true: it drafts again
        policy.observe("b", 1, 1)
    assert policy.num_drafts("b") >= 2


def test_not_adaptive_always_drafts_the_maximum_and_forget_resets() -> None:
    policy = DraftPolicy(max_drafts=3, disable_by_batch_size=8, adaptive=False)
    policy.observe("a", 3, 0)
    assert policy.num_drafts("a", 8) == 3
    adaptive = DraftPolicy(max_drafts=3, disable_by_batch_size=8)
    for _ in range(10):
        adaptive.observe("a", 3, 0)
    adaptive.forget(["a"])
    assert adaptive.num_drafts("a") == 3


def test_the_batch_threshold() -> None:
    policy = DraftPolicy(max_drafts=3, disable_by_batch_size=8)
    assert policy.step_speculates(8) and not policy.step_speculates(9)
    assert device_costs("cpu").disable_by_batch_size == 16
