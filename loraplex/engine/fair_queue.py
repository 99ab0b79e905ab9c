"""The "fair" scheduling policy: Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024), weighted by tenant, with priorities first.

Each tenant has a counter of the service it received: every step, each prompt token computed
for it counts ``prompt_weight`` and each token generated ``output_weight``, divided by the
tenant's weight (``set_tenant_weights``; 1.0 when not given). Charged as the tokens are computed
(``charge``, once per step), so a long prefill or a long generation counts while it runs, not
when it is admitted. Admission takes, among the tenants with waiting requests, the one whose
next request has the best priority, then the smallest counter::

    tenant   counter   waiting            next admitted: b1 (priority 0, counter 40),
    a          120     a1(p0) a2(p0)      then b2 or a1 as the counters move;
    b           40     b1(p0) b2(p0)      a request of priority -1 would go before all
    None        75     o1(p1)

Within a tenant, priority then first come first served. Requests without a tenant (the
operator, offline use) are one more tenant (``None``). A tenant that becomes backlogged again
(a request arrives while none of its requests waits) has its counter lifted to the smallest
counter of the tenants that are (those waiting, else those running, else the last such value):
time spent idle is not banked into a burst later.

Preemption: the KV victim is the running request of the worst priority, then of the tenant
that received the most service, newest first; for admission, running requests of a strictly
worse priority than the waiting one, in the same order (as ``PriorityQueue``). Seats are fair
too: when every seat (``max_num_seqs``) is taken and the request due next belongs to a tenant
holding fewer running requests than its weighted share of them, the newest requests of tenants
holding more than their share (and served more) are preempted for it, only as many as they
hold beyond their share. Without this a light tenant waits for a whole round of a flood's
long requests to finish; with it, a step or two (its prefix-cached blocks make the victim's
recomputation cheap).

Adapter slots: when the next request of the tenant the policy would serve needs a LoRA slot
and none is free, it *claims* one: until it is admitted, other tenants' adapter requests of its
priority or a worse one are not admitted (base-model requests still are), so the slots drain as
their running requests finish, and the claimant goes first within its priority once a slot is
free. One claim at a time; a cold request of a strictly better priority takes it over. The
``StarvationGuard`` bound holds as well (a starving request holds back its own tenant's
adapter requests and those of tenants not below their share of the slots). Slots are fair like
seats: when the claimant's tenant holds fewer slots than its weighted share of them, the
running requests of one adapter of the tenant holding the most slots beyond its share are
preempted (``slot_victims``), so a light tenant's adapter waits a step or two instead of a
whole round of a heavy tenant's requests on many adapters.
"""

from __future__ import annotations

from collections import Counter
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

Tenant = str | None


class FairQueue:
    priority_preemption = True

    def __init__(
        self,
        prompt_weight: float = 1.0,
        output_weight: float = 2.0,
        lora_starvation_steps: int = LORA_STARVATION_STEPS,
    ) -> None:
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self._lines: dict[Tenant, PriorityLine] = {}  # tenants with waiting requests only
        self._num_waiting = 0
        self._counters: dict[Tenant, float] = {}  # every tenant seen: its virtual service
        self._order: dict[Tenant, int] = {}  # first-seen order: the last tie-break
        self._weights: dict[str, float] = {}
        self._running: Counter[Tenant] = Counter()  # running requests per tenant (last step)
        self._floor = 0.0  # the smallest counter of the backlogged tenants, when last any were
        self._guard = StarvationGuard(lora_starvation_steps)
        self._share = SlotOrder()  # only its view of who is below its share of the slots
        self._claim: Request | None = None  # an adapter request the slots drain for
        # the admission pass: None while no pass is open
        self._lora_ready: Callable[[str], bool] | None = None
        self._pending: dict[Tenant, float] = {}  # service estimated for requests admitted in it
        self._chosen: PriorityLine | None = None  # the line of the request ``peek`` returned
        self._passed: set[int] = set()  # id() of the requests passed over (a LoRA wait each)

    # ---- contents ----------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        line = self._lines.get(req.tenant)
        if line is None or not len(line):
            self._lift(req.tenant)
        self._line(req.tenant).add(req)
        self._num_waiting += 1

    def prepend(self, req: Request) -> None:
        """A preempted request: first among its priority in its tenant's line. Its tenant was
        being served, not idle: no lift."""
        self._line(req.tenant).prepend(req)
        self._num_waiting += 1

    def _line(self, tenant: Tenant) -> PriorityLine:
        self._seen(tenant)
        line = self._lines.get(tenant)
        if line is None:
            line = self._lines[tenant] = PriorityLine()
        return line

    def _seen(self, tenant: Tenant) -> None:
        if tenant not in self._order:
            self._order[tenant] = len(self._order)
            self._counters[tenant] = 0.0

    def _lift(self, tenant: Tenant) -> None:
        """``tenant`` becomes backlogged: its counter rises to the smallest counter of the other
        tenants with waiting requests (else of those running, else the last such value)."""
        self._seen(tenant)
        others = [self._counters[t] for t, line in self._lines.items() if len(line) and t != tenant]
        if not others:
            others = [self._counters[t] for t in self._running if t != tenant]
        floor = min(others) if others else self._floor
        self._counters[tenant] = max(self._counters[tenant], floor)

    def remove(self, req: Request) -> bool:
        line = self._lines.get(req.tenant)
        if line is None or not line.remove(req):
            return False
        self._num_waiting -= 1
        if req is self._claim:
            self._claim = None
        if not len(line) and self._lora_ready is None:
            del self._lines[req.tenant]
        return True

    def __len__(self) -> int:
        return self._num_waiting

    def __iter__(self) -> Iterator[Request]:
        """Tenant by tenant, in the order their next requests would be admitted now."""
        ranked: list[tuple[tuple[int, int, float, float, int], PriorityLine]] = []
        for tenant, line in self._lines.items():
            head = line.first()
            if head is not None:
                ranked.append((self._rank(tenant, head), line))
        for _, line in sorted(ranked, key=lambda x: x[0]):
            yield from line

    # ---- admission -------------------------------------------------------------------------

    def begin_admission(
        self,
        lora_ready: Callable[[str], bool],
        holds_slot: Callable[[str], bool] | None = None,
        slots: TenantSlots | None = None,
    ) -> None:
        """The slot claim orders slots here; ``slots`` only tells the starvation bound which
        tenants are below their share (another tenant's starving request does not hold them)."""
        if self._lora_ready is not None:
            raise RuntimeError("an admission pass is already open; call end_admission first")
        self._lora_ready = lora_ready
        self._guard.open(r for line in self._lines.values() for r in line)
        self._share.open(holds_slot, slots, (r for line in self._lines.values() for r in line))

    def peek(self) -> Request | None:
        if self._lora_ready is None:
            raise RuntimeError("peek outside an admission pass; call begin_admission first")
        self._update_claim()
        best: tuple[tuple[int, int, float, float, int], PriorityLine, Request] | None = None
        for tenant, line in self._lines.items():
            req = self._next_eligible(tenant, line)
            if req is None:
                continue
            rank = self._rank(tenant, req)
            if best is None or rank < best[0]:
                best = (rank, line, req)
        if best is None:
            self._chosen = None
            return None
        self._chosen = best[1]
        return best[2]

    def _rank(self, tenant: Tenant, req: Request) -> tuple[int, int, float, float, int]:
        """Admission order across tenants: priority, the claimant first, the counter (with
        what this pass admitted), the longest waiting, the tenant seen first."""
        counter = self._counters[tenant] + self._pending.get(tenant, 0.0)
        claimant = 0 if req is self._claim else 1
        return (req.priority, claimant, counter, req.arrival_time, self._order[tenant])

    def _update_claim(self) -> None:
        """The tenant to serve next (by its next request, ready or not): when that request
        needs a slot and none is free, it claims one."""
        lora_ready = self._lora_ready
        assert lora_ready is not None
        heads = [(t, line.current()) for t, line in self._lines.items()]
        ranked = [(self._rank(t, r), r) for t, r in heads if r is not None]
        if not ranked:
            return
        _, head = min(ranked, key=lambda x: x[0])
        claim = self._claim
        if (
            head.lora_key is not None
            and not lora_ready(head.lora_key)
            and (claim is None or head.priority < claim.priority)
        ):
            self._claim = head

    def _next_eligible(self, tenant: Tenant, line: PriorityLine) -> Request | None:
        """Move the line's cursor past requests that may not be admitted in this pass (each
        counts a LoRA wait); the request at the cursor, or None."""
        while (req := line.current()) is not None:
            if self._eligible(tenant, req):
                return req
            if id(req) not in self._passed:
                self._passed.add(id(req))
                req.lora_wait_steps += 1
            line.cursor += 1
        return None

    def _eligible(self, tenant: Tenant, req: Request) -> bool:
        key = req.lora_key
        if key is None:
            return True
        assert self._lora_ready is not None
        if not self._lora_ready(key):
            return False
        claim = self._claim
        if claim is req:
            return True
        if self._guard.blocks(req, self._share.below_share(req.tenant)):
            return False
        return claim is None or claim.tenant == tenant or req.priority < claim.priority

    def pop(self) -> Request:
        line = self._chosen
        if line is None:
            raise RuntimeError("pop without a request from peek")
        req = line.pop_current()
        self._num_waiting -= 1
        self._chosen = None
        if req is self._claim:
            # The requests its claim held back may go now: look at them again.
            self._claim = None
            for other in self._lines.values():
                other.reset()
        # Until the step is charged, an estimate orders the rest of this pass.
        estimate = self.prompt_weight * req.num_tokens + self.output_weight
        self._pending[req.tenant] = self._pending.get(req.tenant, 0.0) + estimate / self._weight(
            req.tenant
        )
        return req

    def end_admission(self) -> None:
        for tenant in [t for t, line in self._lines.items() if not len(line)]:
            del self._lines[tenant]
        for line in self._lines.values():
            line.reset()
        self._pending.clear()
        self._passed.clear()
        self._chosen = None
        self._lora_ready = None

    # ---- service and weights ---------------------------------------------------------------

    def charge(self, served: Sequence[Service], running: Sequence[Request]) -> None:
        w_in, w_out = self.prompt_weight, self.output_weight
        for s in served:
            tenant = s.request.tenant
            self._seen(tenant)
            cost = (w_in * s.prompt_tokens + w_out * s.output_tokens) / self._weight(tenant)
            self._counters[tenant] += cost
        self._running = Counter(r.tenant for r in running)
        for tenant in self._running:
            self._seen(tenant)
        active = [self._counters[t] for t in self._lines] or [
            self._counters[t] for t in self._running
        ]
        if active:
            self._floor = min(active)

    def charge_work(self, tenant: Tenant, cost: float) -> None:
        """Adapter loads and mask work are service too: the pool's pages, the copy and the
        mask time are the tenant's."""
        self._seen(tenant)
        self._counters[tenant] += cost / self._weight(tenant)

    def _weight(self, tenant: Tenant) -> float:
        return 1.0 if tenant is None else self._weights.get(tenant, 1.0)

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        self._weights = dict(weights)

    def virtual_service(self) -> Mapping[Tenant, float] | None:
        return dict(self._counters)

    # ---- preemption ------------------------------------------------------------------------

    def _victim_rank(self, running: Sequence[Request], i: int) -> tuple[int, float, int]:
        req = running[i]
        return (req.priority, self._counters.get(req.tenant, 0.0), i)

    def preemption_victim(self, running: list[Request], first: int) -> int:
        return max(range(first, len(running)), key=lambda i: self._victim_rank(running, i))

    def admission_victims(self, running: Sequence[Request], waiting: Request) -> list[Request]:
        order = sorted(
            range(len(running)), key=lambda i: self._victim_rank(running, i), reverse=True
        )
        worse = [running[i] for i in order if running[i].priority > waiting.priority]
        return worse or self._seat_victims(running, waiting, order)

    def slot_victims(
        self, running: Sequence[Request], max_loras: int
    ) -> tuple[Request, list[Request]] | None:
        claim = self._claim
        if claim is None or claim.lora_key is None:
            return None
        held: dict[Tenant, dict[str, list[Request]]] = {}
        for r in running:
            if r.lora_key is not None:
                held.setdefault(r.tenant, {}).setdefault(r.lora_key, []).append(r)
        in_use = sum(len(a) for a in held.values())
        if in_use < max_loras or any(claim.lora_key in a for a in held.values()):
            return None  # a slot is free, or its adapter holds one: nothing to make room for
        tenants = set(held) | {claim.tenant}
        total = sum(self._weight(t) for t in tenants)
        share = {t: max_loras * self._weight(t) / total for t in tenants}
        mine = len(held.get(claim.tenant, {}))
        if mine + 1 > share[claim.tenant] + 0.5:
            return None  # at or near its share of the slots already
        over = [
            (len(adapters) - share[t], t)
            for t, adapters in held.items()
            if t != claim.tenant and len(adapters) - 1 >= share[t]
        ]
        if not over:
            return None
        _, tenant = max(over, key=lambda x: (x[0], self._counters.get(x[1], 0.0)))
        # the adapter whose requests are cheapest to recompute: fewest tokens computed
        users = min(held[tenant].values(), key=lambda rs: sum(r.num_computed_tokens for r in rs))
        if any(r.priority < claim.priority for r in users):
            return None  # never preempt a better priority
        return claim, list(users)

    def _seat_victims(
        self, running: Sequence[Request], waiting: Request, order: list[int]
    ) -> list[Request]:
        """Victims of the same priority for a request whose tenant holds fewer seats than its
        weighted share of the running ones: the newest requests of tenants that hold more
        than their share and have received more service, as many as they hold beyond it."""
        seats = Counter(r.tenant for r in running)
        tenant = waiting.tenant
        active = set(seats) | {t for t, line in self._lines.items() if len(line)} | {tenant}
        total = sum(self._weight(t) for t in active)
        share = {t: len(running) * self._weight(t) / total for t in active}
        if seats[tenant] + 1 > share[tenant] + 0.5:  # at or near its share already
            return []
        mine = self._counters.get(tenant, 0.0)
        spare = {t: int(seats[t] - share[t]) for t in seats if self._counters[t] > mine}
        victims: list[Request] = []
        for i in order:
            r = running[i]
            if r.priority == waiting.priority and spare.get(r.tenant, 0) > 0:
                spare[r.tenant] -= 1
                victims.append(r)
        return victims
