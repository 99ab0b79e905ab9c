"""The pieces the scheduling policies share: requests in priority order with an admission cursor,
the priority-aware LoRA starvation bound, and the check of tenant weights."""

from __future__ import annotations

import math

import pytest

from loraplex.engine.admission import PriorityLine, StarvationGuard, check_tenant_weights
from loraplex.engine.request import Request
from loraplex.sampling_params import SamplingParams


def req(rid: str, priority: int = 0, lora_key: str | None = None) -> Request:
    return Request(rid, [1, 2], SamplingParams(max_tokens=2), lora_key=lora_key, priority=priority)


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


def test_tenant_weights_are_checked() -> None:
    assert check_tenant_weights({"a": 3, "b": 0.5}) == {"a": 3.0, "b": 0.5}
    assert check_tenant_weights({"a": 0.01, "b": 100}) == {"a": 0.01, "b": 100.0}
    for bad in (0, -1, math.nan, math.inf, True, "2", 5e-324, 0.0099, 100.5):
        with pytest.raises(ValueError, match="weight of tenant 'a'"):
            check_tenant_weights({"a": bad})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="keyed by tenant id"):
        check_tenant_weights({None: 1.0})  # type: ignore[dict-item]
