"""Paged KV cache manager: block tables, reference counts, a free queue, prefix caching.

Pure Python (no torch): it hands out block ids; the runner owns the tensors they index.

    request tokens:  t0 ... t15 | t16 ... t31 | t32 t33 t34
    block table:     [   7      ,     3       ,     12    ]   (block_size 16)
    slot of token i: table[i // 16] * 16 + i % 16

* Block 0 is the null block: never handed out; padding in block tables points at it.
* A block is shared by reference count (prefix-cache hits, the samples of an n > 1 request).
  A shared block is never written: full blocks are immutable, and a shared partial block is
  copied (copy-on-write) before a request appends to it.
* A full block is registered under ``hash(parent_hash, its tokens, extra keys)``. When its last
  user frees it, it stays in the cache, on the free queue, until the queue hands it out again
  (LRU eviction). Freed blocks without a hash go to the front of the queue so they are reused
  before any cached block is evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass

from loraplex.engine.request import Request

NULL_BLOCK = 0
_ROOT_HASH = b"loraplex-kv-v1"


def hash_block(parent: bytes, token_ids: list[int], extra_keys: tuple[str, ...]) -> bytes:
    """SHA-256 over the parent block's hash, this block's tokens and the extra keys."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x00" + key.encode())
    return h.digest()


@dataclass
class KVCacheStats:
    prefix_queries: int = 0  # prompt tokens looked up at admission
    prefix_hits: int = 0  # of those, tokens served from the cache
    evictions: int = 0  # cached blocks handed out again


@dataclass
class _Block:
    ref_cnt: int = 0
    block_hash: bytes | None = None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (one is the null block); got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._blocks[NULL_BLOCK].ref_cnt = 1
        # Free queue in eviction order: the head is handed out first. OrderedDict gives O(1)
        # append, pop-front and removal from the middle (a cache hit on a free block).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a table already registered
        self._copies: list[tuple[int, int]] = []
        self.stats = KVCacheStats()

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request (cached free blocks count as free)."""
        return self.num_usable_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------

    def update_block_hashes(self, req: Request) -> None:
        """Extend ``req.block_hashes`` to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        tokens = req.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], req.cache_extra_keys))

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Longest run of cached blocks that starts the request's tokens.

        At least one token is always left to compute (its logits are needed), so a hit covers
        at most ``num_tokens - 1`` tokens, in whole blocks.
        """
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.prefix_queries += num_tokens
        self.stats.prefix_hits += num_hit_tokens

    # ---- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req``; False (and no change) if the
        free queue is too short.

        ``new_computed_blocks`` are prefix-cache hits (from ``get_computed_blocks``) that the
        request takes over on admission; they count as computed tokens.
        ``num_lookahead_tokens``: room for that many tokens more after the new ones, which are
        not the request's yet (draft tokens): their blocks are never registered in the prefix
        cache; those of the drafts accepted are, when the request is scheduled next.
        """
        hits = new_computed_blocks or []
        table = self._tables.get(req.request_id, [])
        num_total = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_new_blocks, cow, num_taken = self._plan(
            req, num_new_tokens + num_lookahead_tokens, hits
        )
        if num_taken > len(self._free):
            return False

        if req.request_id not in self._tables:
            self._tables[req.request_id] = table
            self._num_hashed[req.request_id] = 0
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1
            table.append(block_id)
        self._num_hashed[req.request_id] += len(hits)
        if cow:
            src = table[-1]
            dst = self._pop_free()
            self._blocks[src].ref_cnt -= 1
            table[-1] = dst
            self._copies.append((src, dst))
        for _ in range(num_new_blocks):
            table.append(self._pop_free())
        if self.enable_prefix_caching:
            # Tokens scheduled now are computed before anyone can look them up again.
            self._register_full_blocks(req, num_total)
        return True

    def _plan(self, req: Request, num_new_tokens: int, hits: list[int]) -> tuple[int, bool, int]:
        """An allocation's new blocks, whether it copies a shared partial last block first, and
        how many blocks it takes off the free queue in all."""
        table = self._tables.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(hits) * self.block_size
        num_new_blocks = self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(hits)
        # Hits on free (cached, unreferenced) blocks take them off the free queue.
        num_revived = sum(1 for b in hits if self._blocks[b].ref_cnt == 0)
        # Appending into a shared partial last block needs a private copy first.
        cow = bool(
            table
            and num_new_tokens > 0
            and num_computed % self.block_size != 0
            and self._blocks[table[-1]].ref_cnt > 1
        )
        return num_new_blocks, cow, max(num_new_blocks, 0) + num_revived + int(cow)

    def num_blocks_short(
        self, req: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> int:
        """How many blocks the free queue lacks for ``allocate_slots`` with these arguments
        (0: it fits)."""
        _, _, num_taken = self._plan(req, num_new_tokens, new_computed_blocks or [])
        return max(num_taken - len(self._free), 0)

    def num_freed_by(self, request_ids: list[str], keep: list[int] | None = None) -> int:
        """Blocks that would go back to the free queue if these requests freed theirs (blocks
        in ``keep`` not counted: prefix hits the room is for, which it takes back at once)."""
        refs = Counter(b for rid in request_ids for b in self._tables.get(rid, ()))
        kept = set(keep or ())
        return sum(1 for b, n in refs.items() if self._blocks[b].ref_cnt == n and b not in kept)

    def _register_full_blocks(self, req: Request, num_tokens: int) -> None:
        table = self._tables[req.request_id]
        start = self._num_hashed[req.request_id]
        end = num_tokens // self.block_size
        if end <= start:
            return
        self.update_block_hashes(req)
        for i in range(start, end):
            block_hash = req.block_hashes[i]
            block = self._blocks[table[i]]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = table[i]
        self._num_hashed[req.request_id] = end

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            self.stats.evictions += 1
        block.ref_cnt = 1
        return block_id

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared by reference (no copy yet)."""
        table = self._tables[parent_id]
        for block_id in table:
            self._blocks[block_id].ref_cnt += 1
        self._tables[child_id] = list(table)
        self._num_hashed[child_id] = self._num_hashed[parent_id]

    def free(self, request_id: str) -> None:
        """Drop the request's references; blocks nobody holds go back to the free queue."""
        table = self._tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        if table is not None:
            self._release(table)

    def _release(self, blocks: list[int]) -> None:
        # Reverse order: a prompt's tail blocks are the least likely to be shared, so they are
        # evicted before its head blocks.
        for block_id in reversed(blocks):
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Keep the KV of the request's first ``num_tokens`` tokens only (rejected draft tokens,
        a grammar rollback)::

            block_size 4, 10 tokens trimmed to 6:
            before  [ t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  .  ]
            after   [ t0 t1 t2 t3 | t4 t5 .  .  ]                the third block is released
                      full: kept    now partial: rewritten from t6 on

        Released blocks go back as ``free`` returns them: a full one keeps its hash (its KV
        is still that of the tokens it was registered under) and stays cached. The block that
        became partial loses its hash if this request alone holds it, since the request writes
        into it next; a shared one keeps its hash and is copied before the next write
        (copy-on-write). ``req.block_hashes`` keeps only the full blocks of the request's
        tokens (truncate them first, ``Request.truncate``, when they change too).
        """
        bs = self.block_size
        table = self._tables.get(req.request_id)
        held = len(table) * bs if table is not None else 0
        if not 0 <= num_tokens <= held:
            raise ValueError(
                f"request {req.request_id!r} holds KV for at most {held} tokens; "
                f"cannot trim it to {num_tokens}"
            )
        del req.block_hashes[req.num_tokens // bs :]
        if table is None:
            return
        num_full = num_tokens // bs
        keep = self.blocks_needed(num_tokens)
        self._release(table[keep:])
        del table[keep:]  # in place: scheduled records reference the table
        self._num_hashed[req.request_id] = min(self._num_hashed[req.request_id], num_full)
        if keep > num_full:  # the last block kept is partial now
            block_id = table[-1]
            block = self._blocks[block_id]
            if block.block_hash is not None and block.ref_cnt == 1:
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) pairs recorded since the last call; the runner does them."""
        copies, self._copies = self._copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds (e.g. after an adapter is removed)."""
        for block_id in list(self._free):
            block = self._blocks[block_id]
            if block.block_hash is not None:
                self._cached.pop(block.block_hash, None)
                block.block_hash = None

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant is broken (used by tests)."""
        counts = [0] * self.num_blocks
        counts[NULL_BLOCK] = 1
        for table in self._tables.values():
            for block_id in table:
                if block_id == NULL_BLOCK:
                    raise AssertionError("the null block is in a block table")
                counts[block_id] += 1
        for block_id, block in enumerate(self._blocks):
            if block.ref_cnt != counts[block_id]:
                raise AssertionError(
                    f"block {block_id}: ref_cnt {block.ref_cnt} but {counts[block_id]} users"
                )
            if (block.ref_cnt == 0) != (block_id in self._free):
                raise AssertionError(f"block {block_id}: free queue and ref_cnt disagree")
        for block_hash, block_id in self._cached.items():
            if self._blocks[block_id].block_hash != block_hash:
                raise AssertionError(f"cached block {block_id} has another hash")
