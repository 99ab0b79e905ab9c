"""Scheduling policy: the order waiting requests are admitted in, and who is preempted.

The scheduler owns the running list and the KV blocks; a ``WaitingQueue`` owns the waiting
requests and the two choices a policy makes (after vLLM's ``RequestQueue``):

* **admission order.** Each step the scheduler opens an admission pass (``begin_admission``),
  then repeatedly ``peek``s the request the policy would admit next and ``pop``s it once it is
  admitted. A request whose admission fails (no KV room) is left unpopped and keeps its place.
  Requests the policy passes over during the pass (an adapter without a free LoRA slot) are set
  aside and put back in their places by ``end_admission``.
* **the preemption victims**: which running request gives its blocks back when the pool runs
  dry, and which running requests may make room for a waiting one (priority preemption).
* **service**: once per step the scheduler reports what each request received (``charge``), so
  a policy can count it per tenant, weighted by ``set_tenant_weights``.

Three policies (``make_waiting_queue``): ``FCFSQueue`` (here), ``PriorityQueue``
(``priority_queue.py``) and ``FairQueue`` (``fair_queue.py``, Virtual Token Counter).

Pure Python, no torch: a policy is tested alone with the fake runner in milliseconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from loraplex.config import SchedulerConfig, SchedulingPolicy
from loraplex.engine.admission import (
    LORA_STARVATION_STEPS,
    Service,
    SlotOrder,
    StarvationGuard,
    TenantSlots,
)
from loraplex.engine.fair_queue import FairQueue
from loraplex.engine.priority_queue import PriorityQueue
from loraplex.engine.request import Request

__all__ = [
    "LORA_STARVATION_STEPS",
    "FCFSQueue",
    "FairQueue",
    "PriorityQueue",
    "Service",
    "WaitingQueue",
    "make_waiting_queue",
]


class WaitingQueue(Protocol):
    """The waiting requests of one scheduler, in the policy's order."""

    # Whether ``admission_victims`` may name any: the scheduler then also looks at the next
    # request when no seat is free (FCFS does not, so its passes stay as they were).
    priority_preemption: bool

    def add(self, req: Request) -> None:
        """A new request (or a sample released by its leader): queue it by the policy."""
        ...

    def prepend(self, req: Request) -> None:
        """A preempted request: first in line again (it already waited its turn)."""
        ...

    def remove(self, req: Request) -> bool:
        """Drop ``req`` (an abort) wherever it waits; False when it is not queued here."""
        ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in admission order."""
        ...

    def begin_admission(
        self,
        lora_ready: Callable[[str], bool],
        holds_slot: Callable[[str], bool] | None = None,
        slots: TenantSlots | None = None,
    ) -> None:
        """Open this step's admission pass. ``lora_ready(key)``: whether a request on adapter
        ``key`` can get a LoRA device slot now; ``holds_slot(key)``: whether adapter ``key``
        holds one already (its requests need no new slot); ``slots``: the slots per tenant
        (``SlotOrder`` shares them between tenants)."""
        ...

    def peek(self) -> Request | None:
        """The request to admit next in this pass, or None when no more may be admitted."""
        ...

    def pop(self) -> Request:
        """Take the request ``peek`` returned: the scheduler admitted it."""
        ...

    def end_admission(self) -> None:
        """Close the pass: requests passed over during it go back to their places."""
        ...

    def preemption_victim(self, running: list[Request], first: int) -> int:
        """Index in ``running`` of the request to preempt, at least ``first`` (the requests
        before it are already scheduled this step; ``running[first]`` needs the room)."""
        ...

    def admission_victims(self, running: Sequence[Request], waiting: Request) -> list[Request]:
        """The running requests that may be preempted so that ``waiting`` (which found no seat
        or no KV room) can be admitted, best victim first; empty when none may. A victim must
        never be able to preempt back the request it made room for."""
        ...

    def slot_victims(
        self, running: Sequence[Request], max_loras: int
    ) -> tuple[Request, list[Request]] | None:
        """When every LoRA slot is held and the request the policy would serve next waits for
        one: that request and the running requests to preempt so that a slot frees (all those
        of one adapter), or None. Called at the end of an admission pass; the victims are
        preempted when the next step starts."""
        ...

    def charge(self, served: Sequence[Service], running: Sequence[Request]) -> None:
        """One step's service, once per step after its tokens were appended; ``running``: the
        requests still running after it."""
        ...

    def charge_work(self, tenant: str | None, cost: float) -> None:
        """Work ``tenant``'s requests caused beyond their tokens (an adapter load, a constraint's
        token masks), priced in tokens of service (the scheduler's ``LOAD_BYTES_PER_TOKEN``,
        ``MASK_SECONDS_PER_TOKEN``): a policy that counts service counts it."""
        ...

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """Tenant id -> weight (checked: finite, above 0) for the service charged from now on;
        a tenant not named weighs 1.0."""
        ...

    def virtual_service(self) -> Mapping[str | None, float] | None:
        """Each tenant's counter of weighted service; None for a policy that keeps none."""
        ...


class FCFSQueue:
    """First come, first served, with a bound on how long a cold adapter can wait.

    An adapter request that cannot get a LoRA slot is passed over (``lora_wait_steps`` counts
    the steps it was), so the base and hot-adapter requests behind it are not blocked; new
    slots go in arrival order within a tenant and are shared between tenants (``SlotOrder``):
    a tenant's backlog of cold adapters does not hold another tenant's adapter request back.
    Once a waiting request has been passed over ``LORA_STARVATION_STEPS`` times, no adapter
    request that waited less may pass it (``StarvationGuard``: of its tenant, or of a tenant
    not below its share of the slots): the slots drain, and it gets one within a bounded
    time. The victim of a preemption is the newest running request.
    """

    priority_preemption = False

    def __init__(self, lora_starvation_steps: int = LORA_STARVATION_STEPS) -> None:
        self.lora_starvation_steps = lora_starvation_steps
        self._queue: deque[Request] = deque()
        self._skipped: list[Request] = []  # passed over in this pass, in queue order
        self._lora_ready: Callable[[str], bool] | None = None  # None: no pass open
        self._guard = StarvationGuard(lora_starvation_steps, by_priority=False)
        self._slots = SlotOrder()

    # ---- contents ----------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self._queue.append(req)

    def prepend(self, req: Request) -> None:
        self._queue.appendleft(req)

    def remove(self, req: Request) -> bool:
        for queue in (self._queue, self._skipped):
            for i, queued in enumerate(queue):
                if queued is req:  # identity: a dataclass == would compare every field
                    del queue[i]
                    return True
        return False

    def __len__(self) -> int:
        return len(self._queue) + len(self._skipped)

    def __iter__(self) -> Iterator[Request]:
        yield from self._skipped
        yield from self._queue

    # ---- admission -------------------------------------------------------------------------

    def begin_admission(
        self,
        lora_ready: Callable[[str], bool],
        holds_slot: Callable[[str], bool] | None = None,
        slots: TenantSlots | None = None,
    ) -> None:
        if self._lora_ready is not None:
            raise RuntimeError("an admission pass is already open; call end_admission first")
        self._lora_ready = lora_ready
        self._slots.open(holds_slot, slots, self._queue)
        self._guard.open(iter(self._queue))

    def peek(self) -> Request | None:
        lora_ready = self._lora_ready
        if lora_ready is None:
            raise RuntimeError("peek outside an admission pass; call begin_admission first")
        queue = self._queue
        while queue:
            req = queue[0]
            if req.lora_key is None or (
                lora_ready(req.lora_key)
                and not self._guard.blocks(req, self._slots.below_share(req.tenant))
                and not self._slots.blocks(req)
            ):
                return req
            self._slots.passed(req)
            req.lora_wait_steps += 1
            self._skipped.append(queue.popleft())
        return None

    def pop(self) -> Request:
        req = self._queue.popleft()
        self._slots.took(req)
        return req

    def end_admission(self) -> None:
        self._queue.extendleft(reversed(self._skipped))
        self._skipped.clear()
        self._lora_ready = None

    # ---- preemption ------------------------------------------------------------------------

    def preemption_victim(self, running: list[Request], first: int) -> int:
        return len(running) - 1

    def admission_victims(self, running: Sequence[Request], waiting: Request) -> list[Request]:
        return []  # first come, first served: nobody is preempted for a later request

    def slot_victims(
        self, running: Sequence[Request], max_loras: int
    ) -> tuple[Request, list[Request]] | None:
        return None

    # ---- service and weights (this policy keeps no counters) -------------------------------

    def charge(self, served: Sequence[Service], running: Sequence[Request]) -> None:
        pass

    def charge_work(self, tenant: str | None, cost: float) -> None:
        pass

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        pass

    def virtual_service(self) -> Mapping[str | None, float] | None:
        return None


def make_waiting_queue(
    policy: SchedulingPolicy = "fcfs", config: SchedulerConfig | None = None
) -> WaitingQueue:
    """The waiting queue of a scheduling policy (``SchedulerConfig.scheduling_policy``);
    ``config`` gives the fair policy its prices (``fair_prompt_weight``,
    ``fair_output_weight``)."""
    config = config or SchedulerConfig()
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "fair":
        return FairQueue(config.fair_prompt_weight, config.fair_output_weight)
    raise ValueError(f"unknown scheduling policy {policy!r}; known: fcfs, priority, fair")
