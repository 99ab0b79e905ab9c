"""KV cache manager alone: allocation, free order, prefix hits and misses, eviction, COW."""

from __future__ import annotations

import pytest

from loraplex.engine.kv_cache import NULL_BLOCK, KVCacheManager, hash_block
from loraplex.engine.request import Request
from loraplex.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], extra: tuple[str, ...] = ()) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), cache_extra_keys=extra)


def admit(kv: KVCacheManager, r: Request) -> int:
    hits = kv.get_computed_blocks(r)
    n_hit = len(hits) * kv.block_size
    assert kv.allocate_slots(r, r.num_tokens - n_hit, hits)
    r.num_computed_tokens = r.num_tokens
    return n_hit


def test_allocation_counts_and_null_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.num_free_blocks == 7
    r = req("a", list(range(10)))  # 10 tokens -> 3 blocks
    assert kv.allocate_slots(r, 10)
    table = kv.block_table("a")
    assert len(table) == 3 and NULL_BLOCK not in table
    assert kv.num_free_blocks == 4
    r.num_computed_tokens = 10
    r.append_output_token(99)
    assert kv.allocate_slots(r, 1)  # position 10 lies in block 2: no new block
    assert len(kv.block_table("a")) == 3
    kv.check_integrity()


def test_allocation_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = req("a", list(range(9)))  # needs 3 blocks, only 2 usable
    assert not kv.allocate_slots(r, 9)
    assert kv.num_free_blocks == 2
    kv.check_integrity()


def test_free_returns_blocks_tail_first() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=2, enable_prefix_caching=False)
    r = req("a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert kv.allocate_slots(r, 8)
    table = list(kv.block_table("a"))
    kv.free("a")
    assert kv.num_free_blocks == 4
    # Unhashed blocks go to the front, in table order, so the head of the table is reused first.
    r2 = req("b", [1, 2])
    assert kv.allocate_slots(r2, 2)
    assert kv.block_table("b") == [table[0]]
    kv.check_integrity()


def test_prefix_hit_and_miss() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(12)))
    assert admit(kv, a) == 0
    b = req("b", [*range(8), 100, 101, 102, 103, 104])
    assert admit(kv, b) == 8  # first two blocks shared
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]
    c = req("c", [5, *range(1, 12)])
    assert admit(kv, c) == 0  # differs in the first token: no hit
    kv.check_integrity()


def test_full_hit_leaves_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, req("a", list(range(8))))
    b = req("b", list(range(8)))
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 1  # 8 tokens = 2 blocks but the last token must be recomputed


def test_extra_keys_isolate_cache() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, req("base", list(range(12))))
    assert admit(kv, req("lora", list(range(12)), extra=("adapter-sha-1",))) == 0
    assert admit(kv, req("lora-v2", list(range(12)), extra=("adapter-sha-2",))) == 0
    assert admit(kv, req("lora-again", list(range(12)), extra=("adapter-sha-1",))) == 8
    assert admit(kv, req("tenant", list(range(12)), extra=("adapter-sha-1", "salt-b"))) == 0
    assert hash_block(b"", [1, 2], ("x",)) != hash_block(b"", [1, 2], ())


def test_cached_blocks_survive_free_and_evict_lru() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=2)  # 4 usable
    a = req("a", [1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] [5]
    admit(kv, a)
    kv.free("a")
    assert kv.num_cached_blocks == 2 and kv.num_free_blocks == 4
    b = req("b", [1, 2, 3, 4, 9])
    assert admit(kv, b) == 4  # both full blocks revived from the free queue
    kv.free("b")
    # A request that needs every block evicts the cached ones (oldest first).
    c = req("c", [7, 7, 7, 7, 7, 7, 7, 7])
    assert kv.allocate_slots(c, 8)
    assert kv.num_cached_blocks == 0 or kv.stats.evictions > 0
    kv.check_integrity()
    kv.free("c")
    d = req("d", [1, 2, 3, 4, 9])
    assert admit(kv, d) == 0  # evicted
    kv.check_integrity()


def test_lru_order_evicts_least_recently_freed() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)  # 3 usable
    a = req("a", [1, 2, 0])
    admit(kv, a)
    kv.free("a")  # cached block [1,2]; the partial one is unhashed
    b = req("b", [3, 4, 0])
    admit(kv, b)
    kv.free("b")  # cached block [3,4], freed later
    c = req("c", [5, 6])  # needs one block: evicts [1,2], the least recently freed
    assert kv.allocate_slots(c, 2)
    c.num_computed_tokens = 2
    kv.free("c")
    assert admit(kv, req("x", [3, 4, 8])) == 2
    kv.free("x")
    assert admit(kv, req("y", [1, 2, 8])) == 0


def test_fork_and_copy_on_write() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    p = req("p", list(range(6)))  # 1 full + 1 partial block
    admit(kv, p)
    kv.fork("p", "c")
    assert kv.block_table("c") == kv.block_table("p")
    child = req("c", list(range(6)))
    child.num_computed_tokens = 6
    p.append_output_token(50)
    child.append_output_token(60)
    shared_tail = kv.block_table("p")[-1]
    assert kv.allocate_slots(p, 1)
    assert kv.take_copies() == [(shared_tail, kv.block_table("p")[-1])]
    assert kv.block_table("p")[-1] != shared_tail
    assert kv.allocate_slots(child, 1)  # now the only user: writes in place
    assert kv.take_copies() == []
    assert kv.block_table("c")[-1] == shared_tail
    assert kv.block_table("c")[0] == kv.block_table("p")[0]
    kv.check_integrity()
    kv.free("p")
    kv.free("c")
    kv.check_integrity()
    assert kv.num_free_blocks == 9


def test_reset_prefix_cache_drops_only_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=2)
    admit(kv, req("a", [1, 2, 3]))
    admit(kv, req("b", [4, 5, 6]))
    kv.free("a")
    kv.reset_prefix_cache()
    assert admit(kv, req("a2", [1, 2, 3])) == 0
    assert admit(kv, req("b2", [4, 5, 6])) == 2
    kv.check_integrity()


def test_too_few_blocks_is_an_error() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=1, block_size=16)


# ---- trimming a request's last tokens (speculative decoding, grammar rollback) ----------------


def grown(rid: str, prompt: list[int], outputs: list[int]) -> Request:
    r = req(rid, prompt)
    for t in outputs:
        r.append_output_token(t)
    return r


def hits_of(kv: KVCacheManager, tokens: list[int]) -> int:
    """Tokens a new request with these tokens would take from the prefix cache."""
    return len(kv.get_computed_blocks(req("probe", tokens))) * kv.block_size


def test_trim_within_a_block_keeps_every_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = grown("a", [0, 1, 2], list(range(3, 10)))  # [0..3] [4..7] [8 9]
    admit(kv, a)
    table = list(kv.block_table("a"))
    a.truncate(9)
    kv.trim(a, 9)
    assert kv.block_table("a") == table and kv.num_free_blocks == 4
    assert hits_of(kv, [*range(8), 50]) == 8  # both full blocks still cached
    kv.check_integrity()


def test_trim_across_blocks_releases_the_tail_and_unhashes_the_partial_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = grown("a", [0, 1, 2], list(range(3, 10)))
    admit(kv, a)
    table = list(kv.block_table("a"))
    assert kv.num_cached_blocks == 2
    a.truncate(5)
    kv.trim(a, 5)
    assert kv.block_table("a") == table[:2]
    assert kv.num_free_blocks == 5
    assert len(a.block_hashes) == 1  # only [0..3] is a full block of its tokens
    # [4..7] is now written from position 5 on: it must not be found under its old hash
    assert kv.num_cached_blocks == 1
    assert hits_of(kv, [*range(8), 50]) == 4
    # the released tail block had no hash: it is handed out first
    b = req("b", [100, 101])
    assert kv.allocate_slots(b, 2)
    assert kv.block_table("b") == [table[2]]
    kv.check_integrity()


def test_trim_to_a_block_boundary_keeps_the_full_blocks_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = grown("a", [0, 1, 2], list(range(3, 10)))
    admit(kv, a)
    a.truncate(8)
    kv.trim(a, 8)
    assert len(kv.block_table("a")) == 2 and kv.num_free_blocks == 5
    assert len(a.block_hashes) == 2 and kv.num_cached_blocks == 2
    assert hits_of(kv, [*range(8), 50]) == 8
    kv.check_integrity()


def test_full_blocks_released_by_a_trim_stay_cached_and_new_tokens_get_new_hashes() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = grown("a", [0, 1, 2], list(range(3, 12)))  # three full blocks, all cached
    admit(kv, a)
    a.truncate(4)
    kv.trim(a, 4)
    assert kv.num_cached_blocks == 3  # released whole: still valid for their tokens
    assert hits_of(kv, [*range(12), 50]) == 12
    a.num_computed_tokens = 4
    for t in (70, 71, 72, 73, 74):  # it continues with other tokens from position 4
        a.append_output_token(t)
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 9
    assert hits_of(kv, [0, 1, 2, 3, 70, 71, 72, 73, 9]) == 8
    assert hits_of(kv, [*range(12), 50]) == 12  # the old continuation is still there
    kv.check_integrity()


def test_trim_keeps_shared_blocks_intact_and_copies_before_writing() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=4)
    a = grown("a", [0, 1, 2], list(range(3, 12)))
    admit(kv, a)
    b = req("b", [*range(8), 60, 61])
    assert admit(kv, b) == 8  # shares a's first two blocks
    shared = kv.block_table("a")[1]
    a.truncate(6)
    kv.trim(a, 6)  # [4..7] is partial for a, but b still reads all of it
    assert kv.block_table("a") == kv.block_table("b")[:2]
    assert hits_of(kv, [*range(8), 50]) == 8  # its hash stays: its content is unchanged
    a.num_computed_tokens = 6
    a.append_output_token(99)
    assert kv.allocate_slots(a, 1)  # writes position 6: a private copy first
    (copy,) = kv.take_copies()
    assert copy[0] == shared and kv.block_table("a")[1] == copy[1] != shared
    assert kv.block_table("b")[1] == shared
    assert hits_of(kv, [*range(8), 50]) == 8
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    kv.check_integrity()
    assert kv.num_used_blocks == 0


def test_trim_a_forked_sample_leaves_its_sibling_alone() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    p = req("p", list(range(6)))
    admit(kv, p)
    kv.fork("p", "c")
    c = req("c", list(range(6)))
    c.num_computed_tokens = 6
    kv.trim(c, 2)
    assert kv.block_table("c") == kv.block_table("p")[:1]
    assert len(kv.block_table("p")) == 2
    kv.check_integrity()
    kv.free("p")
    kv.free("c")
    assert kv.num_used_blocks == 0
    kv.check_integrity()


def test_trim_to_zero_and_errors() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(6)))
    admit(kv, a)
    with pytest.raises(ValueError, match="at most 8 tokens"):
        kv.trim(a, 9)
    with pytest.raises(ValueError, match="cannot trim"):
        kv.trim(a, -1)
    kv.trim(a, 0)
    assert kv.block_table("a") == [] and kv.num_used_blocks == 0
    a.num_computed_tokens = 0
    assert kv.allocate_slots(a, 6)  # and it grows again
    assert len(kv.block_table("a")) == 2
    kv.check_integrity()
    waiting = grown("w", [1], list(range(8)))  # holds no blocks: only its hashes change
    kv.update_block_hashes(waiting)
    assert len(waiting.block_hashes) == 2
    waiting.truncate(6)
    kv.trim(waiting, 0)
    assert len(waiting.block_hashes) == 1


def test_blocks_short_and_blocks_freed_by_requests() -> None:
    kv = KVCacheManager(9, 4)  # 8 usable blocks
    a = Request("a", list(range(12)), SamplingParams())
    b = Request("b", [*range(12), 99], SamplingParams())
    assert kv.allocate_slots(a, 12)  # 3 blocks
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 3 and kv.allocate_slots(b, 1, hits)  # shares a's 3, takes 1
    c = Request("c", list(range(100, 124)), SamplingParams())
    assert kv.num_blocks_short(c, 24) == 6 - 4  # 6 blocks wanted, 4 free
    assert not kv.allocate_slots(c, 24)
    assert kv.num_freed_by(["b"]) == 1  # the shared blocks stay with a
    assert kv.num_freed_by(["a", "b"]) == 4
    assert kv.num_freed_by(["a", "b"], keep=hits[:1]) == 3
    assert kv.num_blocks_short(c, 16) == 0 and kv.allocate_slots(c, 16)
