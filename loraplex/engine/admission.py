"""What every scheduling policy shares: the service one step gave a request (``Service``, what
the scheduler charges), the LoRA starvation bound, requests kept in priority order with an
admission cursor (``PriorityLine``), and the check of tenant weights. Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from loraplex.config import TENANT_WEIGHT_RANGE
from loraplex.engine.request import Request

Tenant = str | None

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


@dataclass(frozen=True)
class TenantSlots:
    """The LoRA step slots when an admission pass opens, as the scheduler sees them."""

    max_loras: int
    free: int  # slots no adapter holds
    held: Mapping[Tenant, int]  # per tenant: adapters holding a slot for its running requests


class SlotOrder:
    """Who may take a new LoRA slot in an admission pass (the FCFS and priority policies; the
    fair policy has its own claim). Slots are a tenant resource under every policy:

    * **Arrival order within a tenant.** Once a pass has passed over an adapter request of a
      tenant whose adapter holds no slot (it waits for one, or for its load), later adapter
      requests of that tenant, of its priority or a worse one, whose adapters hold no slot are
      passed over too: a cold adapter is not overtaken for the next free slot by the tenant's
      adapters that came after it. So are those of every other tenant at or over its share.
    * **Equal shares between tenants.** With ``n`` tenants holding or waiting for slots, a
      tenant's share is ``max_loras / n``. A tenant at or over its share takes no new slot
      while the free slots are no more than the tenants below their share that have a waiting
      request (of the same or a better priority) needing one: the next free slot goes to them,
      however long the other tenant's backlog waited. With one tenant, this is plain arrival
      order.

    Requests on adapters that hold a slot always pass (they take no new one). Without
    ``holds_slot`` (a pass opened by a test alone): no order."""

    def __init__(self) -> None:
        self._holds: Callable[[str], bool] | None = None
        self._passed: dict[Tenant, int] = {}  # tenant -> best priority passed over this pass
        self._share = 0.0  # 0: one tenant (no sharing)
        self._held: Counter[Tenant] = Counter()
        self._free = 0
        self._short: dict[Tenant, int] = {}  # below its share, waiting: tenant -> best priority
        self._claims: Counter[Tenant] = Counter()  # waiting requests that need a new slot

    def open(
        self,
        holds_slot: Callable[[str], bool] | None,
        slots: TenantSlots | None = None,
        waiting: Iterable[Request] = (),
    ) -> None:
        self._holds = holds_slot
        self._passed = {}
        self._short = {}
        self._share = 0.0
        if holds_slot is None or slots is None:
            return
        claims: dict[Tenant, int] = {}
        self._claims = Counter()
        for r in waiting:
            if self.needs_slot(r):
                claims[r.tenant] = min(claims.get(r.tenant, r.priority), r.priority)
                self._claims[r.tenant] += 1
        tenants = {t for t, n in slots.held.items() if n > 0} | set(claims)
        if len(tenants) < 2:
            return
        self._share = slots.max_loras / len(tenants)
        self._held = Counter(slots.held)
        self._free = slots.free
        self._short = {t: p for t, p in claims.items() if self._held[t] < self._share}

    def needs_slot(self, req: Request) -> bool:
        return (
            self._holds is not None and req.lora_key is not None and not self._holds(req.lora_key)
        )

    def below_share(self, tenant: Tenant) -> bool:
        """Whether ``tenant`` holds fewer slots than its share (False with one tenant)."""
        return self._share > 0 and self._held[tenant] < self._share

    def blocks(self, req: Request) -> bool:
        if not self.needs_slot(req):
            return False
        tenant, below = req.tenant, self.below_share(req.tenant)
        if any(p <= req.priority and (t == tenant or not below) for t, p in self._passed.items()):
            return True
        if below or self._share == 0:
            return False
        claims = sum(1 for t, p in self._short.items() if t != tenant and p <= req.priority)
        return claims > 0 and self._free <= claims

    def passed(self, req: Request) -> None:
        if self.needs_slot(req):
            self._passed[req.tenant] = min(self._passed.get(req.tenant, req.priority), req.priority)

    def took(self, req: Request) -> None:
        """``req`` is admitted (called before its slot is taken)."""
        if not self.needs_slot(req):
            return
        tenant = req.tenant
        self._held[tenant] += 1
        self._free -= 1
        self._claims[tenant] -= 1
        if tenant in self._short and (
            self._held[tenant] >= self._share or self._claims[tenant] <= 0
        ):
            del self._short[tenant]


class StarvationGuard:
    """The LoRA starvation bound: once a waiting request has been passed over ``limit`` times,
    adapter requests that waited less may not pass it, so the slots drain and it gets one:
    those of its tenant, and those of every other tenant not below its share of the slots
    (``SlotOrder.below_share``; with one tenant, every request). With ``by_priority``, only
    requests of its priority or a worse one (a strictly better priority still passes: that is
    what priority means); without, every one (FCFS). Judged once per pass."""

    def __init__(self, limit: int = LORA_STARVATION_STEPS, by_priority: bool = True) -> None:
        self.limit = limit
        self.by_priority = by_priority
        self._starving: dict[Tenant, int] = {}  # tenant -> best priority among its starving

    def open(self, waiting: Iterable[Request]) -> None:
        self._starving = {}
        for r in waiting:
            if r.lora_wait_steps >= self.limit:
                p = self._priority(r)
                self._starving[r.tenant] = min(self._starving.get(r.tenant, p), p)

    def _priority(self, req: Request) -> int:
        return req.priority if self.by_priority else 0

    def blocks(self, req: Request, below_share: bool = False) -> bool:
        """Whether ``req`` (an adapter request) may not pass a starving one in this pass;
        ``below_share``: its tenant holds fewer slots than its share."""
        if req.lora_wait_steps >= self.limit:
            return False
        prio = self._priority(req)
        return any(
            p <= prio and (t == req.tenant or not below_share) for t, p in self._starving.items()
        )
