"""The adapter pool's bookkeeping: which pages each resident adapter holds. Pure Python.

The device memory for adapters is one pool of pages per target module (``q_proj``, ``k_proj``,
...), every module with the same number of pages. A page is one rank-row of that module in every
decoder layer: A's row (``in`` values) and B's row (``out`` values) per layer. An adapter of rank
r in a module takes exactly r of its pages, so memory follows the real weights, not
``max_lora_rank``::

    module pool (P pages)   | a0 a1 a2 a3 | b0 .. b7 | -- free -- | c0 | ...
                              adapter a     adapter b              adapter c
                              rank 4        rank 8                 rank 1

An adapter is ``loading`` from the moment its pages are reserved until its copy is done, then
``ready``. Adapters with running requests (``in_use``) and pinned ones are never evicted; when a
load needs room the least recently used other ready adapters go first.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

PageState = Literal["loading", "ready"]


class PoolFullError(RuntimeError):
    """An adapter needs more pages of a module than the whole pool has."""


@dataclass
class Residency:
    """One resident adapter: its pages per module (rank-row order) and its load state."""

    key: str
    pages: dict[str, list[int]]  # module -> pool rows, row k holds rank-row k
    state: PageState = "loading"
    generation: int = 0  # bumped by every load: a slot whose generation differs is stale


@dataclass
class PoolCounters:
    """What the pool decides (loads and their bytes are the manager's, which copies)."""

    evictions: int = 0  # ready adapters dropped to make room
    deferred: int = 0  # reservations refused: no room without evicting an adapter in use


class PagePool:
    """Free pages of one module's pool: lowest rows first, so loads into an empty pool take
    contiguous runs (the kernels read any order, but runs read faster)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be 0 or more, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # a heap (sorted is a heap)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolFullError(f"{n} pages wanted, {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def give_back(self, pages: list[int]) -> None:
        for p in pages:
            heapq.heappush(self._free, p)


@dataclass
class AdapterPool:
    """Residency of adapters in the page pools (``pages_per_module`` pages in each module)."""

    pages_per_module: Mapping[str, int]
    pinned: set[str] = field(default_factory=set)
    on_evict: Callable[[str], None] | None = None  # told of every adapter that leaves the pool
    counters: PoolCounters = field(default_factory=PoolCounters)

    def __post_init__(self) -> None:
        self._pools = {m: PagePool(n) for m, n in self.pages_per_module.items()}
        self._resident: OrderedDict[str, Residency] = OrderedDict()  # least recently used first
        self._generation = 0

    # ---- queries ---------------------------------------------------------------------------

    def get(self, key: str) -> Residency | None:
        return self._resident.get(key)

    def is_ready(self, key: str) -> bool:
        res = self._resident.get(key)
        return res is not None and res.state == "ready"

    def resident(self) -> list[str]:
        return list(self._resident)

    def pages_total(self) -> int:
        return sum(p.num_pages for p in self._pools.values())

    def pages_used(self) -> int:
        return sum(p.num_pages - p.num_free for p in self._pools.values())

    def pages_used_by_module(self) -> dict[str, int]:
        return {m: p.num_pages - p.num_free for m, p in self._pools.items()}

    def check_fits(self, ranks: Mapping[str, int]) -> None:
        """Raise ``PoolFullError`` when an adapter of these per-module ranks can never fit."""
        for module, r in ranks.items():
            pool = self._pools.get(module)
            if pool is None:
                raise PoolFullError(f"the pool has no pages for module {module!r}")
            if r > pool.num_pages:
                raise PoolFullError(
                    f"rank {r} in {module} needs {r} pages; the pool has {pool.num_pages} per "
                    "module"
                )

    # ---- changes ---------------------------------------------------------------------------

    def touch(self, key: str) -> None:
        if key in self._resident:
            self._resident.move_to_end(key)

    def reserve(
        self,
        key: str,
        ranks: Mapping[str, int],
        in_use: Callable[[str], bool],
        order: Sequence[str] | None = None,
    ) -> Residency | None:
        """Take pages for ``key`` (state ``loading``), evicting ready adapters that are neither
        in use nor pinned, in ``order`` (default: least recently used first). None (nothing
        evicted) when even that would not make room; raises ``PoolFullError`` when the adapter
        can never fit."""
        if key in self._resident:
            raise ValueError(f"adapter {key[:12]} is already resident")
        self.check_fits(ranks)
        short = {m: r - self._pools[m].num_free for m, r in ranks.items()}
        victims: list[str] = []
        if any(n > 0 for n in short.values()):
            for other in self._resident if order is None else order:
                res = self._resident.get(other)
                if res is None or res.state != "ready" or other in self.pinned or in_use(other):
                    continue
                victims.append(other)
                for m in short:
                    short[m] -= len(res.pages.get(m, ()))
                if all(n <= 0 for n in short.values()):
                    break
            else:
                self.counters.deferred += 1
                return None
        for victim in victims:
            self.evict(victim)
        self._generation += 1
        res = Residency(
            key=key,
            pages={m: self._pools[m].take(r) for m, r in ranks.items() if r > 0},
            generation=self._generation,
        )
        self._resident[key] = res
        return res

    def mark_ready(self, key: str) -> None:
        self._resident[key].state = "ready"

    def evict(self, key: str, count: bool = True) -> Residency | None:
        """Drop ``key``'s pages (the caller makes sure no running request reads them);
        ``count``: an eviction to make room (False: the adapter was removed or failed)."""
        res = self._resident.pop(key, None)
        if res is None:
            return None
        for m, pages in res.pages.items():
            self._pools[m].give_back(pages)
        if count and res.state == "ready":
            self.counters.evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)
        return res
