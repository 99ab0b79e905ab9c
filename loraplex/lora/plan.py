"""The records of adapter residency's decisions, for the runner to carry out
(``engine/adapter_residency.py`` decides; ``lora/manager.py`` copies and points). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadOrder:
    """Copy adapter ``key`` into ``pages`` (module -> pool rows, rank-row order)."""

    key: str
    generation: int
    pages: dict[str, list[int]]


@dataclass(frozen=True)
class SlotBinding:
    """Slot ``slot`` reads adapter ``key``'s pages of load ``generation`` this step."""

    slot: int
    key: str
    generation: int
    pages: dict[str, list[int]]


@dataclass
class AdapterPlan:
    """The step's adapter work for the runner, in this order: drop host copies, start ``loads`` in the background, point the slots of ``slots`` at their pages
    (a slot whose binding did not change is left as it is)."""

    loads: list[LoadOrder] = field(default_factory=list)
    slots: dict[int, SlotBinding] = field(default_factory=dict)
    drop_host: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.slots or self.drop_host)


@dataclass(frozen=True)
class LoadResult:
    """A finished copy (the runner's report): ``error`` None when the pages hold the weights;
    ``from_disk``: the adapter was parsed again from its source (now in host memory)."""

    key: str
    generation: int
    error: str | None = None
    from_disk: bool = False
