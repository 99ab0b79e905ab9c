"""Which data-parallel replica serves a request: the routing policy of ``DataParallelClient``.

``affinity`` (the default) keeps each adapter and each long shared prefix on the replica that
already holds it, so an adapter is loaded on one replica and a prefix's KV blocks are computed
once, and falls back to the least-loaded replica:

1. Only healthy replicas are candidates (none: ``None``).
2. Holders: the candidates that already hold the request's adapter (a base request: all).
3. Among holders, the replica that last served the longest recorded prefix of this prompt, when
   that prefix covers at least ``PREFIX_MIN_SHARE`` of the prompt (a short common start, such
   as a chat template's system line, does not pull every request to one replica); else the
   holder with the fewest requests in flight. No holder: the least-loaded candidate (it will
   load the adapter).
4. Imbalance bound: when the chosen replica has more than ``spill_factor`` times as many
   requests in flight as the least-loaded candidate, plus ``spill_slack``, the request spills
   to the least-loaded one (which then loads the adapter: a hot adapter spreads, and cannot
   starve the requests of other adapters).

``round_robin`` cycles over the healthy replicas, blind to adapters and prefixes (the
comparison point of ``python -m benchmarks.replicas``).

Prefix identity: ``prefix_chain`` hashes the prompt's first full KV blocks (up to
``MAX_PREFIX_BLOCKS``) chained like the engine's prefix cache, with the adapter's key and the
request's cache salt mixed in, so different adapters or tenants never count as sharing a prefix.
A bounded LRU map remembers which replica last served each chained hash.

Pure Python, no torch: tested with plain records in milliseconds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

RoutingPolicy = Literal["affinity", "round_robin"]
ROUTING_POLICIES: tuple[RoutingPolicy, ...] = ("affinity", "round_robin")

MAX_PREFIX_BLOCKS = 32  # blocks hashed per prompt (512 tokens at block size 16)
PREFIX_MIN_SHARE = 0.5  # a prefix match counts when it covers this much of the prompt (capped)
PREFIX_MAP_SIZE = 65_536  # chained hashes remembered, least recently used dropped first
SPILL_FACTOR = 2.0
SPILL_SLACK = 4


@dataclass(frozen=True)
class ReplicaView:
    """What the router sees of one replica for one request."""

    index: int
    healthy: bool
    inflight: int  # requests routed to it and not finished
    has_adapter: bool  # holds (or is loading) the request's adapter; True for a base request


@dataclass(frozen=True)
class Prefix:
    """A prompt's chained block hashes (``hashes[d]``: its first ``d + 1`` full blocks)."""

    hashes: tuple[int, ...]
    block_size: int
    prompt_len: int

    def min_blocks(self) -> int:
        """The shortest match (in blocks) that counts as sharing this prompt's prefix."""
        covered = min(self.prompt_len, MAX_PREFIX_BLOCKS * self.block_size)
        return max(1, -(-int(covered * PREFIX_MIN_SHARE) // self.block_size))


def prefix_chain(
    token_ids: Sequence[int],
    block_size: int,
    lora_key: str | None = None,
    cache_extra_keys: tuple[str, ...] = (),
) -> Prefix:
    """The chained hashes of the first full blocks of ``token_ids`` (none for a prompt shorter
    than a block). Python's ``hash``: the map lives in this process only."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    full = min(len(token_ids) // block_size, MAX_PREFIX_BLOCKS)
    parent = hash((lora_key, cache_extra_keys))
    hashes = []
    for b in range(full):
        parent = hash((parent, tuple(token_ids[b * block_size : (b + 1) * block_size])))
        hashes.append(parent)
    return Prefix(tuple(hashes), block_size, len(token_ids))


class Router(Protocol):
    policy: RoutingPolicy

    def choose(self, replicas: Sequence[ReplicaView], prefix: Prefix | None) -> int | None:
        """The index of the replica to serve the request; None when no replica is healthy."""
        ...

    def served(self, index: int, prefix: Prefix | None) -> None:
        """The request went to replica ``index``."""
        ...

    def forget_replica(self, index: int) -> None:
        """Replica ``index`` lost its state (it restarted): its prefixes are gone."""
        ...


class RoundRobinRouter:
    policy: RoutingPolicy = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[ReplicaView], prefix: Prefix | None) -> int | None:
        n = len(replicas)
        for step in range(n):
            view = replicas[(self._next + step) % n]
            if view.healthy:
                self._next = (view.index + 1) % n
                return view.index
        return None

    def served(self, index: int, prefix: Prefix | None) -> None:
        pass

    def forget_replica(self, index: int) -> None:
        pass


class AffinityRouter:
    """Adapter first, then prefix, then least loaded, within the imbalance bound (module doc)."""

    policy: RoutingPolicy = "affinity"

    def __init__(
        self,
        spill_factor: float = SPILL_FACTOR,
        spill_slack: int = SPILL_SLACK,
        map_size: int = PREFIX_MAP_SIZE,
    ) -> None:
        if spill_factor < 1.0 or spill_slack < 0 or map_size < 1:
            raise ValueError(
                "need spill_factor >= 1, spill_slack >= 0 and map_size >= 1; got "
                f"{spill_factor}, {spill_slack}, {map_size}"
            )
        self.spill_factor = spill_factor
        self.spill_slack = spill_slack
        self.map_size = map_size
        self._owner: OrderedDict[int, int] = OrderedDict()  # chained prefix hash -> replica
        self.spills = 0  # requests sent away from their affine replica by the bound

    def choose(self, replicas: Sequence[ReplicaView], prefix: Prefix | None) -> int | None:
        healthy = [v for v in replicas if v.healthy]
        if not healthy:
            return None
        least = min(healthy, key=_load)
        holders = [v for v in healthy if v.has_adapter]
        if not holders:
            return least.index
        chosen = self._prefix_owner(holders, prefix) or min(holders, key=_load)
        if chosen.inflight > self.spill_factor * least.inflight + self.spill_slack:
            self.spills += 1
            return least.index
        return chosen.index

    def _prefix_owner(
        self, holders: Sequence[ReplicaView], prefix: Prefix | None
    ) -> ReplicaView | None:
        if prefix is None or not prefix.hashes:
            return None
        by_index = {v.index: v for v in holders}
        for depth in range(len(prefix.hashes), prefix.min_blocks() - 1, -1):
            owner = self._owner.get(prefix.hashes[depth - 1])
            if owner is not None and owner in by_index:
                return by_index[owner]
        return None

    def served(self, index: int, prefix: Prefix | None) -> None:
        if prefix is None:
            return
        for h in prefix.hashes:
            self._owner[h] = index
            self._owner.move_to_end(h)
        while len(self._owner) > self.map_size:
            self._owner.popitem(last=False)

    def forget_replica(self, index: int) -> None:
        for h in [h for h, i in self._owner.items() if i == index]:
            del self._owner[h]


def make_router(policy: RoutingPolicy) -> Router:
    if policy == "affinity":
        return AffinityRouter()
    if policy == "round_robin":
        return RoundRobinRouter()
    raise ValueError(f"unknown routing policy {policy!r}; use {' or '.join(ROUTING_POLICIES)}")


def _load(view: ReplicaView) -> tuple[int, int]:
    return view.inflight, view.index
