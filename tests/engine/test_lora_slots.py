"""``LoRASlots``: which adapters hold the device slots. A slot is held while a running request
uses its adapter; a returning adapter gets its old slot back (no weight copy); free slots are
reused least-recently-released first."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.lora_slots import LoRASlots


def test_the_base_model_needs_no_slot() -> None:
    slots = LoRASlots(1)
    assert slots.acquire(None) == -1 and slots.slot_of(None) == -1
    assert slots.can_acquire(None) and slots.is_resident(None)
    slots.release(None)
    assert slots.in_use() == {}


def test_a_slot_is_held_while_any_request_uses_it() -> None:
    slots = LoRASlots(2)
    a1 = slots.acquire("a")
    assert slots.acquire("a") == a1  # a second request on the same adapter shares its slot
    b = slots.acquire("b")
    assert b != a1 and not slots.can_acquire("c")  # both slots held
    assert slots.can_acquire("a")  # ... but a resident adapter always can
    slots.release("a")
    assert slots.is_resident("a") and not slots.can_acquire("c")  # one request still on "a"
    slots.release("a")
    assert not slots.is_resident("a") and slots.can_acquire("c")
    assert slots.in_use() == {b: "b"}


def test_a_returning_adapter_gets_its_old_slot_back() -> None:
    slots = LoRASlots(3)
    held = {key: slots.acquire(key) for key in ("a", "b", "c")}
    for key in ("a", "b", "c"):
        slots.release(key)
    # Released a, b, c in that order: a newcomer takes the least recently released slot...
    assert slots.acquire("d") == held["a"]
    # ... and a returning adapter its own slot, even when others were free before it.
    assert slots.acquire("c") == held["c"]
    assert slots.acquire("b") == held["b"]


def test_a_newcomer_never_takes_a_slot_in_use_and_order_is_lru() -> None:
    slots = LoRASlots(2)
    s0, s1 = slots.acquire("a"), slots.acquire("b")
    slots.release("b")
    slots.release("a")  # free order: b's slot, then a's
    assert slots.acquire("x") == s1
    assert slots.acquire("y") == s0
    with pytest.raises(StopIteration):
        slots.acquire("z")  # the scheduler asks can_acquire first


def test_random_use_keeps_the_invariants() -> None:
    rng = random.Random(0)
    slots = LoRASlots(3)
    users: dict[str, int] = {}
    last_slot: dict[str, int] = {}
    for _ in range(5000):
        key = rng.choice("abcdef")
        if users.get(key) and rng.random() < 0.5:
            slots.release(key)
            users[key] -= 1
            continue
        if not slots.can_acquire(key):
            assert len({k for k, n in users.items() if n}) == 3 and not users.get(key)
            continue
        was_resident = slots.is_resident(key)
        free_before = set(range(3)) - set(slots.in_use())
        slot = slots.acquire(key)
        users[key] = users.get(key, 0) + 1
        if not was_resident and last_slot.get(key) in free_before:
            assert slot == last_slot[key], "a returning adapter lost its old slot"
        last_slot[key] = slot
        in_use = slots.in_use()
        assert len(set(in_use)) == len(in_use) <= 3
        assert set(in_use.values()) == {k for k, n in users.items() if n}
