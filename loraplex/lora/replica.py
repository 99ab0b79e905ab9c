"""What rank 0's adapter manager did to its pool, for the other tensor-parallel ranks to replay.

Under tensor parallelism only rank 0 decides residency (the scheduler asks it); every rank holds
its own share of each adapter in its own pool, at the same pages. Rank 0's manager records each
decision as one of these records (``LoRAManager.events``); the engine sends them with the next
step, and each other rank's manager replays them in order (``LoRAManager.replay``) before that
step's forward pass. A page is rewritten only after the adapter that held it left the pool, so
replaying in order gives every rank the page index rank 0 has.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FillPages:
    """Copy adapter ``key`` (read by the rank from its own host cache or from disk) into
    ``pages`` (module -> pool rows, rank-row order)."""

    key: str
    pages: dict[str, list[int]]


@dataclass(frozen=True)
class SetSlot:
    """Point slot ``slot`` at ``key``'s ``pages`` (load ``generation``)."""

    slot: int
    key: str
    generation: int
    pages: dict[str, list[int]]


@dataclass(frozen=True)
class ClearSlot:
    slot: int


@dataclass(frozen=True)
class ForgetAdapter:
    """``key`` was removed from the engine."""

    key: str


PoolEvent = FillPages | SetSlot | ClearSlot | ForgetAdapter
