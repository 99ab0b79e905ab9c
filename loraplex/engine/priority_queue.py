"""The "priority" scheduling policy: lower ``Request.priority`` first, first come first served
within a priority (vLLM's priority policy). A request that cannot be admitted for want of a seat
or KV room may have a running request of a strictly worse priority preempted for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from loraplex.engine.admission import (
    LORA_STARVATION_STEPS,
    PriorityLine,
    Service,
    SlotOrder,
    StarvationGuard,
    TenantSlots,
)
from loraplex.engine.request import Request


class PriorityQueue:
    """Waiting requests by (priority, arrival). An adapter request without a LoRA slot is passed
    over and keeps its place; new slots go in arrival order within a tenant and are shared
    between tenants (``SlotOrder``); the starvation bound (``StarvationGuard``) keeps a cold
    adapter from waiting forever behind hot ones of its priority.

    Victims: when the KV pool runs dry, the running request with the largest priority value,
    the newest among equals; for admission, the running requests of a strictly worse priority
    than the waiting one, in the same order. Strictly worse, so a preempted request never
    preempts back the one it made room for.
    """

    priority_preemption = True

    def __init__(self, lora_starvation_steps: int = LORA_STARVATION_STEPS) -> None:
        self._line = PriorityLine()
        self._guard = StarvationGuard(lora_starvation_steps)
        self._slots = SlotOrder()
        self._lora_ready: Callable[[str], bool] | None = None  # None: no pass open

    # ---- contents ----------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self._line.add(req)

    def prepend(self, req: Request) -> None:
        self._line.prepend(req)

    def remove(self, req: Request) -> bool:
        return self._line.remove(req)

    def __len__(self) -> int:
        return len(self._line)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._line)

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
        self._guard.open(iter(self._line))
        self._slots.open(holds_slot, slots, iter(self._line))

    def peek(self) -> Request | None:
        lora_ready = self._lora_ready
        if lora_ready is None:
            raise RuntimeError("peek outside an admission pass; call begin_admission first")
        line = self._line
        while (req := line.current()) is not None:
            key = req.lora_key
            if key is None or (
                lora_ready(key)
                and not self._guard.blocks(req, self._slots.below_share(req.tenant))
                and not self._slots.blocks(req)
            ):
                return req
            self._slots.passed(req)
            req.lora_wait_steps += 1
            line.cursor += 1
        return None

    def pop(self) -> Request:
        req = self._line.pop_current()
        self._slots.took(req)
        return req

    def end_admission(self) -> None:
        self._line.reset()
        self._lora_ready = None

    # ---- service and weights (this policy keeps no counters) -------------------------------

    def charge(self, served: Sequence[Service], running: Sequence[Request]) -> None:
        pass

    def charge_work(self, tenant: str | None, cost: float) -> None:
        pass

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        pass

    def virtual_service(self) -> Mapping[str | None, float] | None:
        return None

    # ---- preemption ------------------------------------------------------------------------

    def preemption_victim(self, running: list[Request], first: int) -> int:
        return max(range(first, len(running)), key=lambda i: (running[i].priority, i))

    def admission_victims(self, running: Sequence[Request], waiting: Request) -> list[Request]:
        order = sorted(range(len(running)), key=lambda i: (running[i].priority, i), reverse=True)
        return [running[i] for i in order if running[i].priority > waiting.priority]

    def slot_victims(
        self, running: Sequence[Request], max_loras: int
    ) -> tuple[Request, list[Request]] | None:
        return None  # slots drain in the order of admission
