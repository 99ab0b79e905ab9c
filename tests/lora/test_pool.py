"""The adapter pool's bookkeeping (pure Python): pages at each adapter's own rank, LRU eviction of
adapters with no running request, pinning, deferral, and adapters that can never fit."""

from __future__ import annotations

import pytest

from loraplex.lora.pool import AdapterPool, PagePool, PoolFullError

MODULES = ("q_proj", "v_proj")


def idle(key: str) -> bool:
    return False


def load(pool: AdapterPool, key: str, ranks: dict[str, int], in_use=idle) -> list[int]:  # type: ignore[no-untyped-def]
    res = pool.reserve(key, ranks, in_use)
    assert res is not None, key
    pool.mark_ready(key)
    return [p for pages in res.pages.values() for p in pages]


def test_each_adapter_takes_exactly_its_rank_per_module() -> None:
    pool = AdapterPool(dict.fromkeys(MODULES, 100))
    load(pool, "r4", {"q_proj": 4, "v_proj": 4})
    load(pool, "r64", {"q_proj": 64, "v_proj": 64})
    load(pool, "q_only", {"q_proj": 8})
    assert pool.pages_used_by_module() == {"q_proj": 76, "v_proj": 68}
    res = pool.get("r4")
    assert res is not None and {m: len(p) for m, p in res.pages.items()} == {
        "q_proj": 4,
        "v_proj": 4,
    }
    # No page is handed out twice.
    for m in MODULES:
        rows = [p for k in pool.resident() for p in pool.get(k).pages.get(m, [])]  # type: ignore[union-attr]
        assert len(rows) == len(set(rows))


def test_lru_adapter_not_in_use_is_evicted_first() -> None:
    evicted: list[str] = []
    pool = AdapterPool(dict.fromkeys(MODULES, 16), on_evict=evicted.append)
    for key in ("a", "b", "c", "d"):
        load(pool, key, dict.fromkeys(MODULES, 4))
    pool.touch("a")  # a is now the most recently used
    assert load(pool, "e", dict.fromkeys(MODULES, 4), in_use=lambda k: k == "b")
    assert evicted == ["c"]  # b is in use, a was touched: c is the oldest idle one
    assert pool.counters.evictions == 1
    assert set(pool.resident()) == {"a", "b", "d", "e"}


def test_pinned_and_in_use_adapters_are_never_evicted() -> None:
    pool = AdapterPool(dict.fromkeys(MODULES, 8), pinned={"p"})
    load(pool, "p", dict.fromkeys(MODULES, 4))
    load(pool, "busy", dict.fromkeys(MODULES, 4))
    assert pool.reserve("new", dict.fromkeys(MODULES, 4), lambda k: k == "busy") is None
    assert pool.counters.deferred == 1
    assert set(pool.resident()) == {"p", "busy"}  # nothing was evicted for a refused load
    assert pool.reserve("new", dict.fromkeys(MODULES, 4), idle) is not None
    assert "busy" not in pool.resident() and "p" in pool.resident()


def test_a_refused_reservation_evicts_nothing() -> None:
    """Evicting one idle adapter would not make room (the rest is in use): keep it."""
    pool = AdapterPool(dict.fromkeys(MODULES, 8))
    load(pool, "idle", dict.fromkeys(MODULES, 2))
    load(pool, "busy", dict.fromkeys(MODULES, 6))
    assert pool.reserve("big", dict.fromkeys(MODULES, 4), lambda k: k == "busy") is None
    assert set(pool.resident()) == {"idle", "busy"}


def test_loading_adapters_are_not_evicted_and_not_ready() -> None:
    pool = AdapterPool(dict.fromkeys(MODULES, 8))
    assert pool.reserve("loading", dict.fromkeys(MODULES, 4), idle) is not None
    assert not pool.is_ready("loading")
    load(pool, "ready", dict.fromkeys(MODULES, 4))
    assert pool.reserve("third", dict.fromkeys(MODULES, 4), idle) is not None
    assert "loading" in pool.resident() and "ready" not in pool.resident()


def test_an_adapter_larger_than_the_pool_is_refused_with_the_numbers() -> None:
    pool = AdapterPool(dict.fromkeys(MODULES, 8))
    with pytest.raises(PoolFullError, match="rank 16 in q_proj needs 16 pages; the pool has 8"):
        pool.reserve("huge", {"q_proj": 16}, idle)
    with pytest.raises(PoolFullError, match="no pages for module 'o_proj'"):
        pool.check_fits({"o_proj": 1})


def test_every_load_gets_a_new_generation() -> None:
    pool = AdapterPool(dict.fromkeys(MODULES, 8))
    first = pool.reserve("a", dict.fromkeys(MODULES, 4), idle)
    assert first is not None
    pool.mark_ready("a")
    pool.evict("a")
    again = pool.reserve("a", dict.fromkeys(MODULES, 4), idle)
    assert again is not None and again.generation > first.generation


def test_page_pool_hands_out_lowest_rows_and_takes_them_back() -> None:
    pages = PagePool(6)
    assert pages.take(3) == [0, 1, 2]
    pages.give_back([1])
    assert pages.take(2) == [1, 3]
    with pytest.raises(PoolFullError):
        pages.take(3)
