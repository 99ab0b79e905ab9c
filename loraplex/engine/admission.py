"""What every scheduling policy shares: the service one step gave a request (``Service``, what
the scheduler charges), the LoRA starvation bound, requests kept in priority order with an
admission cursor (``PriorityLine``), and the check of tenant weights. Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from loraplex.config import TENANT_WEIGHT_RANGE
from loraplex.engine.request import Request

# Steps a skipped adapter request waits before no other adapter request may pass it.
LORA_STARVATION_STEPS = 16


@dataclass(frozen=True)
class Service:
    """What one request received in one step: prompt tokens run through the model (prefill
    chunks; prefix-cache hits are not computed, recomputation after a preemption is) and tokens
    generated (kept: those after a stop are dropped)."""

    request: Request
    prompt_tokens: int
    output_tokens: int


def check_tenant_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """A copy of ``weights`` (tenant id -> share weight), or ``ValueError`` naming the bad
    entry: every weight is a number within ``TENANT_WEIGHT_RANGE``, so a charge divided by it
    stays finite (and so does every fair counter)."""
    low, high = TENANT_WEIGHT_RANGE
    checked: dict[str, float] = {}
    for tenant, weight in weights.items():
        if not isinstance(tenant, str):
            raise ValueError(f"tenant weights are keyed by tenant id (a string); got {tenant!r}")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or not low <= weight <= high
        ):
            raise ValueError(
                f"the weight of tenant {tenant!r} must be a number from {low:g} to {high:g}; "
                f"got {weight!r}"
            )
        checked[tenant] = float(weight)
    return checked


class PriorityLine:
    """Requests in admission order: lower ``priority`` first, first come first served within a
    priority; a preempted request goes first among its priority (it already waited its turn).

    An admission pass walks the line with a cursor: requests before it were passed over in this
    pass and keep their places; ``reset`` (the pass closes) moves the cursor back to the front.
    Requests are never added during a pass (the scheduler adds between steps).
    """

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []  # sorted; parallel to _reqs
        self._reqs: list[Request] = []
        self._key_of: dict[int, tuple[int, int]] = {}  # id(request) -> its key
        self._next = 0  # arrival sequence numbers; prepended requests count down from -1
        self._prev = 0
        self.cursor = 0

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)

    def add(self, req: Request) -> None:
        self._next += 1
        self._insert(req, (req.priority, self._next))

    def prepend(self, req: Request) -> None:
        self._prev -= 1
        self._insert(req, (req.priority, self._prev))

    def _insert(self, req: Request, key: tuple[int, int]) -> None:
        i = bisect.bisect(self._keys, key)
        if i < self.cursor:
            raise RuntimeError("a request was queued during an admission pass")
        self._keys.insert(i, key)
        self._reqs.insert(i, req)
        self._key_of[id(req)] = key

    def remove(self, req: Request) -> bool:
        key = self._key_of.get(id(req))
        if key is None:
            return False
        i = bisect.bisect_left(self._keys, key)
        if self._reqs[i] is not req:  # identity: a dataclass == would compare every field
            return False
        del self._keys[i], self._reqs[i], self._key_of[id(req)]
        if i < self.cursor:
            self.cursor -= 1
        return True

    def current(self) -> Request | None:
        """The request at the cursor (the next one this pass looks at)."""
        return self._reqs[self.cursor] if self.cursor < len(self._reqs) else None

    def first(self) -> Request | None:
        return self._reqs[0] if self._reqs else None

    def pop_current(self) -> Request:
        req = self._reqs[self.cursor]
        del self._keys[self.cursor], self._reqs[self.cursor], self._key_of[id(req)]
        return req

    def seq(self, req: Request) -> int:
        """The request's place among requests of its priority (lower: earlier)."""
        return self._key_of[id(req)][1]

    def reset(self) -> None:
        self.cursor = 0


class SlotOrder:
    """New LoRA slots in admission order: once a pass has passed over an adapter request whose
    adapter holds no slot (it waits for one, or for its load), later adapter requests of its
    priority or a worse one whose adapters hold no slot are passed over too, so a cold adapter
    is not overtaken for the next free slot by adapters that came after it. Requests on
    adapters that hold a slot still pass (they take no new one). Without ``holds_slot`` (a
    pass opened by a test alone): no order."""

    def __init__(self) -> None:
        self._holds: Callable[[str], bool] | None = None
        self._priority: int | None = None  # the best priority passed over this pass

    def open(self, holds_slot: Callable[[str], bool] | None) -> None:
        self._holds = holds_slot
        self._priority = None

    def _needs_slot(self, req: Request) -> bool:
        return (
            self._holds is not None and req.lora_key is not None and not self._holds(req.lora_key)
        )

    def blocks(self, req: Request) -> bool:
        return (
            self._priority is not None and req.priority >= self._priority and self._needs_slot(req)
        )

    def passed(self, req: Request) -> None:
        if self._needs_slot(req) and (self._priority is None or req.priority < self._priority):
            self._priority = req.priority


class StarvationGuard:
    """The LoRA starvation bound of the priority-ordered policies: once a waiting request has
    been passed over ``limit`` times, adapter requests of its priority or a worse one that
    waited less may not pass it, so the slots drain and it gets one. Requests of a strictly
    better priority still pass (that is what priority means). Judged once per pass."""

    def __init__(self, limit: int = LORA_STARVATION_STEPS) -> None:
        self.limit = limit
        self._priority: int | None = None  # the best priority among starving requests

    def open(self, waiting: Iterator[Request]) -> None:
        starving = [r.priority for r in waiting if r.lora_wait_steps >= self.limit]
        self._priority = min(starving) if starving else None

    def blocks(self, req: Request) -> bool:
        """Whether ``req`` (an adapter request) may not pass a starving one in this pass."""
        return (
            self._priority is not None
            and req.priority >= self._priority
            and req.lora_wait_steps < self.limit
        )
