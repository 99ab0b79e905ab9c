"""The pieces the scheduling policies share: requests in priority order with an admission cursor,
the priority-aware LoRA starvation bound, new LoRA slots shared between tenants, and the check
of tenant weights."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from loraplex.engine.admission import (
    PriorityLine,
    SlotOrder,
    StarvationGuard,
    TenantSlots,
    check_tenant_weights,
)
from loraplex.engine.request import Request
from loraplex.sampling_params import SamplingParams


def req(
    rid: str, priority: int = 0, lora_key: str | None = None, tenant: str | None = None
) -> Request:
    return Request(
        rid,
        [1, 2],
        SamplingParams(max_tokens=2),
        lora_key=lora_key,
        priority=priority,
        tenant=tenant,
    )


def ids(line: PriorityLine) -> list[str]:
    return [r.request_id for r in line]


def test_line_orders_by_priority_then_arrival_and_prepends_first_in_its_priority() -> None:
    line = PriorityLine()
    a = req("a", 1)
    for r in (a, req("b", 0), req("c", 1), req("d", -1), req("e", 0)):
        line.add(r)
    assert ids(line) == ["d", "b", "e", "a", "c"]
    p = req("p", 1)
    line.prepend(p)  # preempted: before a and c, still after every better priority
    line.prepend(req("q", 1))  # preempted later: before p
    assert ids(line) == ["d", "b", "e", "q", "p", "a", "c"]
    assert line.seq(p) < 0 < line.seq(a)


def test_line_remove_is_by_identity_and_the_cursor_keeps_places() -> None:
    line = PriorityLine()
    a, b, c = req("a"), req("b"), req("c")
    for r in (a, b, c):
        line.add(r)
    assert not line.remove(req("b"))  # an equal request that is not queued
    line.cursor = 1  # "a" passed over in this pass
    current = line.current()
    assert current is b
    assert line.pop_current() is b and line.current() is c
    assert line.remove(a) and line.cursor == 0 and line.current() is c
    with pytest.raises(RuntimeError, match="during an admission pass"):
        line.cursor = 1
        line.add(req("early", -5))  # would land before the cursor
    line.reset()
    assert line.cursor == 0 and ids(line) == ["c"]


def test_starvation_guard_blocks_its_priority_and_worse_only() -> None:
    guard = StarvationGuard(limit=3)
    starving = req("s", 1, "x")
    starving.lora_wait_steps = 3
    fresh_same, fresh_worse, fresh_better = req("f", 1, "h"), req("w", 2, "h"), req("b", 0, "h")
    guard.open(iter([starving, fresh_same, fresh_worse, fresh_better]))
    assert guard.blocks(fresh_same) and guard.blocks(fresh_worse)
    assert not guard.blocks(fresh_better) and not guard.blocks(starving)
    guard.open(iter([fresh_same]))
    assert not guard.blocks(fresh_same)


def test_a_starving_request_holds_back_only_its_tenant_and_tenants_not_below_their_share() -> None:
    guard = StarvationGuard(limit=3)
    starving = req("s", 0, "x", tenant="a")
    starving.lora_wait_steps = 3
    own, other = req("a2", 0, "y", tenant="a"), req("b1", 0, "z", tenant="b")
    guard.open(iter([starving, own, other]))
    assert guard.blocks(own, below_share=True)  # its own tenant's: arrival order
    assert not guard.blocks(other, below_share=True)  # b holds fewer slots than its share
    assert guard.blocks(other, below_share=False)  # b at its share: its slots drain for "s"


def holds(*keys: str) -> Callable[[str], bool]:
    return lambda key: key in keys


def test_a_tenants_cold_backlog_does_not_take_the_next_slot_from_another_tenant() -> None:
    # 4 slots: a's adapters hold 3, a has 3 more cold requests waiting, b has one (its share: 2)
    a_cold = [req(f"a{i}", 0, f"ka{i}", tenant="a") for i in range(3)]
    b_cold = req("b0", 0, "kb", tenant="b")
    a_hot = req("ah", 0, "hot", tenant="a")
    order = SlotOrder()
    slots = TenantSlots(max_loras=4, free=1, held={"a": 3})
    order.open(holds("hot"), slots, [*a_cold, b_cold, a_hot])
    assert order.below_share("b") and not order.below_share("a")
    assert order.blocks(a_cold[0])  # the one free slot is b's
    order.passed(a_cold[0])
    assert order.blocks(a_cold[1])  # arrival order within a
    assert not order.blocks(b_cold)  # a's backlog, passed over, does not hold b back
    assert not order.blocks(a_hot)  # its adapter holds a slot: takes no new one
    order.took(b_cold)  # b's only claim is served: nothing more is held back for b
    order.open(holds("hot"), TenantSlots(4, 1, {"a": 3}), [*a_cold, a_hot])
    assert not order.blocks(a_cold[0])
    # with two free slots a may take one of them: b's claim still has the other
    order.open(holds("hot"), TenantSlots(4, 2, {"a": 2}), [*a_cold, b_cold])
    assert not order.blocks(a_cold[0])
    order.took(a_cold[0])
    assert order.blocks(a_cold[1])
    order.took(b_cold)  # b's only claim is served: nothing is held back for b any more
    assert not order.blocks(a_cold[1])


def test_one_tenant_keeps_plain_arrival_order() -> None:
    first, later = req("1", 0, "k1", tenant="a"), req("2", 0, "k2", tenant="a")
    order = SlotOrder()
    order.open(holds(), TenantSlots(4, 4, {}), [first, later])
    assert not order.below_share("a")  # no sharing with one tenant
    assert not order.blocks(first)
    order.passed(first)  # e.g. still loading
    assert order.blocks(later)


def test_tenant_weights_are_checked() -> None:
    assert check_tenant_weights({"a": 3, "b": 0.5}) == {"a": 3.0, "b": 0.5}
    assert check_tenant_weights({"a": 0.01, "b": 100}) == {"a": 0.01, "b": 100.0}
    for bad in (0, -1, math.nan, math.inf, True, "2", 5e-324, 0.0099, 100.5):
        with pytest.raises(ValueError, match="weight of tenant 'a'"):
            check_tenant_weights({"a": bad})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="keyed by tenant id"):
        check_tenant_weights({None: 1.0})  # type: ignore[dict-item]
