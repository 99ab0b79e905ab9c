"""Adapter residency: the one owner of where each adapter is and may be. Pure Python, no torch.

On a par with the KV cache manager: the scheduler asks it about adapters and writes its
decisions into ``SchedulerOutput``; the runner only carries them out (copies weights into the
pages it is told, points slot rows at pages) and reports finished copies back in
``RunnerOutput``. The content hash is the adapter's only identity here; its name is kept for
messages only.

Tiers::

    disk   every registered adapter (its source; the runner reads it again when needed)
    host   up to ``max_cpu_loras`` parsed copies, least recently used dropped first (not pinned)
    pool   device pages (``lora/pool.py``): ready, or loading while a background copy runs

What a request on adapter ``k`` is told (``status``):

* ``Ready``: ``k``'s pages hold its weights; it may be admitted (with a free step slot).
* ``Loading``: not yet. The demand is noted; ``plan_step`` (after admission) reserves pages
  for at most ``max_loads_per_step`` wanted adapters and orders their copies. No pages: the
  adapter waits for pages (``loads_deferred`` counts each wait once, not each step).
* ``Failed(reason)``: its load failed (file missing, changed, corrupt, NaN weights, copy error,
  larger than the pool). It stays failed, and every request on it ends with the reason, until
  it is registered again or ``retry`` clears it.

Invariants:

* An adapter holding a step slot is never evicted: admission only takes ``Ready`` adapters and
  eviction happens after admission (``plan_step``), sparing every adapter in a slot.
* A freshly loaded adapter that still has waiting demand is not evicted before it has served
  (held a slot) once: no load-evict ping-pong; except for another tenant's load while its own
  tenant holds more than its share of the pages (a tenant's prefetch never keeps another
  tenant's adapter out of the pool).
* Pool pages are a tenant resource: each resident adapter's pages count for the tenant that
  caused its load; when a load needs room, adapters of tenants holding more than their weighted
  share are evicted first (least recently used within), then the least recently used others;
  but a load that would take its tenant over its weighted share of all the pool's pages evicts
  no adapter of another tenant that held a slot within ``IDLE_STEPS`` steps: it waits for one
  of its own (or an over-share tenant's, or an idle one's).
* A load in flight keeps its pages until its result arrives, even when the adapter was removed
  meanwhile (the copy may still be writing them).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from loraplex.engine.lora_slots import LoRASlots
from loraplex.lora.plan import AdapterPlan, LoadOrder, LoadResult, SlotBinding
from loraplex.lora.pool import AdapterPool, PoolFullError, Residency

__all__ = [
    "IDLE_STEPS",
    "LOADING",
    "READY",
    "AdapterPlan",
    "AdapterResidency",
    "AdapterState",
    "Failed",
    "LoadOrder",
    "LoadResult",
    "Loading",
    "Ready",
    "SlotBinding",
]

Tenant = str | None
Tier = Literal["device", "host", "disk"]

# An adapter that held a slot within this many steps is in use by its tenant: the load of a
# tenant over its share of the pool does not evict it (see the invariants).
IDLE_STEPS = 256


@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class Loading:
    pass


@dataclass(frozen=True)
class Failed:
    reason: str  # a sentence for the client: names the adapter and the cause


READY = Ready()
LOADING = Loading()
AdapterState = Ready | Loading | Failed


@dataclass
class ResidencyStats:
    slot_loads: int = 0  # copies into the pool that succeeded
    load_failures: int = 0
    load_bytes: int = 0  # bytes of adapter weights copied into the pool
    disk_loads: int = 0  # copies that had to parse the adapter from disk again
    host_hits: int = 0  # copies served from a host copy
    host_evictions: int = 0
    loads_deferred: int = 0  # waits for pool pages (each wait counted once)


@dataclass
class _Entry:
    name: str
    ranks: dict[str, int]  # module -> rank (pages it takes of that module's pool)
    nbytes: int  # its weights at the pool's dtype
    tenant: Tenant = None  # who caused its current residency (pool page accounting)
    served: bool = True  # False from a load's end until it first held a slot
    last_step: int = -IDLE_STEPS - 1  # the last step it held a slot


class AdapterResidency:
    def __init__(
        self,
        pages_per_module: Mapping[str, int],
        max_cpu_loras: int,
        max_loras: int = 1,
        max_loads_per_step: int = 2,
        on_load: Callable[[Tenant, int], None] | None = None,
    ) -> None:
        """``max_loras``: the step slots (``slots``: which adapters hold them, taken and
        released by the scheduler as requests start and end). ``on_load(tenant, nbytes)``: told
        of every load started, to charge the tenant (the fair policy counts loads as
        service)."""
        if max_loads_per_step < 1:
            raise ValueError(f"max_loads_per_step must be at least 1, got {max_loads_per_step}")
        self.slots = LoRASlots(max_loras)
        self._pinned: set[str] = set()
        self.pool = AdapterPool(pages_per_module, pinned=self._pinned)
        self.max_cpu_loras = max_cpu_loras
        self.max_loads_per_step = max_loads_per_step
        self.on_load = on_load
        self.stats = ResidencyStats()
        self._entries: dict[str, _Entry] = {}
        self._host: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._failed: dict[str, str] = {}
        self._loading: dict[str, int] = {}  # key -> generation of its copy in flight
        self._wanted: dict[str, Tenant] = {}  # demand seen this step, in order
        self._waiting_pages: set[str] = set()  # adapters in a wait for pages (counted once)
        self._weights: dict[str, float] = {}
        self._drop_host: list[str] = []
        self._step = 0  # plan_step calls

    # ---- registration ----------------------------------------------------------------------

    def register(
        self, key: str, name: str, ranks: Mapping[str, int], nbytes: int, *, in_host: bool = True
    ) -> None:
        """Know adapter ``key`` (parsed and validated by the runner). ``PoolFullError`` when it
        can never fit the pool. Registering a failed adapter again clears its failure."""
        self.pool.check_fits(ranks)
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = _Entry(name, dict(ranks), nbytes)
        else:
            entry.name = name
        self._failed.pop(key, None)
        if in_host:
            self._put_host(key)

    def forget(self, key: str) -> None:
        """Drop ``key`` everywhere (the caller made sure no request uses it; the engine core
        tells the runner's store itself). Pages being
        written by a copy in flight stay reserved until its result arrives."""
        if self._entries.pop(key, None) is None:
            return
        self._failed.pop(key, None)
        self._pinned.discard(key)
        self._host.pop(key, None)
        self._wanted.pop(key, None)
        self._waiting_pages.discard(key)
        if key not in self._loading:
            self.pool.evict(key, count=False)

    def has(self, key: str) -> bool:
        return key in self._entries

    def name_of(self, key: str) -> str:
        entry = self._entries.get(key)
        return entry.name if entry is not None else key[:12]

    def pin(self, key: str, pinned: bool = True) -> None:
        if pinned:
            self._pinned.add(key)
        else:
            self._pinned.discard(key)

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        self._weights = dict(weights)

    def retry(self, key: str) -> bool:
        """Forget ``key``'s failure: the next request loads it again. False when it had none."""
        return self._failed.pop(key, None) is not None

    # ---- what the scheduler asks -----------------------------------------------------------

    def status(self, key: str, tenant: Tenant = None) -> AdapterState:
        """Whether a request on ``key`` may run now. Not ready: the demand is noted, and
        ``plan_step`` starts the load (no side effect here beyond that note)."""
        if self.pool.is_ready(key):
            entry = self._entries.get(key)
            if entry is not None and not entry.served:
                self._wanted.setdefault(key, tenant)  # still wanted: keep it until it serves
            return READY
        why = self._failed.get(key)
        if why is not None:
            return Failed(why)
        if key not in self._entries:
            return Failed(f"adapter {key[:12]} is not registered with the engine")
        self._wanted.setdefault(key, tenant)
        return LOADING

    def failure(self, key: str) -> str | None:
        return self._failed.get(key)

    def plan_step(self, slots: Mapping[int, str]) -> AdapterPlan:
        """The step's adapter work, once admission is done: ``slots`` (slot -> key) are the
        adapters this step's requests use, every one of them ready. Starts loads for the
        adapters wanted this step, evicting only adapters in no slot."""
        self._step += 1
        in_slot = set(slots.values())
        for key in in_slot:
            self.pool.touch(key)
            entry = self._entries.get(key)
            if entry is not None:
                entry.served = True
                entry.last_step = self._step
        plan = AdapterPlan()
        wanted, self._wanted = self._wanted, {}
        for key, tenant in wanted.items():
            if len(plan.loads) >= self.max_loads_per_step:
                break
            if key in self._loading or self.pool.get(key) is not None or key in self._failed:
                continue
            order = self._reserve(key, tenant, in_slot.__contains__, wanted)
            if order is not None:
                plan.loads.append(order)
        for slot, key in slots.items():
            res = self.pool.get(key)
            if res is None or res.state != "ready":
                raise RuntimeError(
                    f"slot {slot} was given adapter {self.name_of(key)!r}, which is not ready "
                    "(admission must ask status() first)"
                )
            plan.slots[slot] = SlotBinding(slot, key, res.generation, res.pages)
        plan.drop_host, self._drop_host = self._drop_host, []
        return plan

    def reserve_now(self, key: str, in_use: Callable[[str], bool]) -> LoadOrder | None:
        """Pages for ``key`` outside a step (a pin): the load to run at once, None when it is
        in the pool already. ``RuntimeError`` when the pool has no room without evicting an
        adapter ``in_use`` (holding a slot) or pinned."""
        if self.pool.get(key) is not None:
            return None
        if key not in self._entries:
            raise KeyError(f"adapter {key[:12]} is not registered with the engine")
        order = self._reserve(key, None, in_use, {})  # in_use: the slot holders
        if order is None:
            raise RuntimeError(
                f"the adapter pool has no room for {self.name_of(key)!r}: every resident "
                "adapter is in use or pinned; raise --lora-memory"
            )
        return order

    def _reserve(
        self,
        key: str,
        tenant: Tenant,
        held: Callable[[str], bool],
        wanted: Mapping[str, Tenant],
    ) -> LoadOrder | None:
        entry = self._entries[key]
        order, over, loader_over = self._victim_order(tenant, sum(entry.ranks.values()))

        def keep(other: str) -> bool:
            if held(other):
                return True
            e = self._entries.get(other)
            if e is None or e.tenant in over:
                return False
            # a fresh adapter still wanted waits to serve once, unless its tenant holds more
            # than its share of the pool and the load is another tenant's
            if not e.served and other in wanted:
                return True
            # a tenant over its share makes room with its own adapters, not with another
            # tenant's adapter in use
            return loader_over and e.tenant != tenant and self._step - e.last_step <= IDLE_STEPS

        try:
            res = self.pool.reserve(key, entry.ranks, keep, order=order)
        except PoolFullError as exc:
            self._fail(key, f"it does not fit the device adapter pool ({exc}); raise --lora-memory")
            return None
        if res is None:
            if not self._could_fit(entry.ranks):
                self._fail(
                    key,
                    "the device adapter pool is full of pinned adapters; the operator must "
                    "unpin one or raise --lora-memory",
                )
                return None
            if key not in self._waiting_pages:
                self._waiting_pages.add(key)
                self.stats.loads_deferred += 1
            return None
        self._waiting_pages.discard(key)
        entry.tenant = tenant
        entry.served = False
        self._loading[key] = res.generation
        if key in self._host:
            self._host.move_to_end(key)
            self.stats.host_hits += 1
        if self.on_load is not None:
            self.on_load(tenant, entry.nbytes)
        return LoadOrder(key, res.generation, {m: list(p) for m, p in res.pages.items()})

    def _could_fit(self, ranks: Mapping[str, int]) -> bool:
        """Whether pages for ``ranks`` exist once every adapter not pinned is gone."""
        pinned: Counter[str] = Counter()
        for key in self._pinned:
            res = self.pool.get(key)
            for module, rows in (res.pages if res is not None else {}).items():
                pinned[module] += len(rows)
        size = self.pool.pages_per_module
        return all(r <= size.get(m, 0) - pinned[m] for m, r in ranks.items())

    def _victim_order(self, tenant: Tenant, need: int) -> tuple[list[str], set[Tenant], bool]:
        """Resident adapters in the order they should make room for ``tenant``'s load of
        ``need`` pages: those of other tenants holding more than their weighted share of the
        pool's pages first, then by least recent use; those other tenants; and whether
        ``tenant`` would hold more than its share of all the pool's pages with this load."""
        used: Counter[Tenant] = Counter()
        for key in self.pool.resident():
            entry = self._entries.get(key)
            res = self.pool.get(key)
            if entry is not None and res is not None:
                used[entry.tenant] += sum(len(p) for p in res.pages.values())
        holders = set(used) | {tenant}
        total_w = sum(self._weight(t) for t in holders)
        pages = sum(used.values())
        over = {t for t in used if t != tenant and used[t] > pages * self._weight(t) / total_w}
        lru = self.pool.resident()
        first = [k for k in lru if (e := self._entries.get(k)) is not None and e.tenant in over]
        size = sum(self.pool.pages_per_module.values())
        loader_over = used[tenant] + need > size * self._weight(tenant) / total_w
        return first + [k for k in lru if k not in set(first)], over, loader_over

    def _weight(self, tenant: Tenant) -> float:
        return 1.0 if tenant is None else self._weights.get(tenant, 1.0)

    # ---- what the runner reports -----------------------------------------------------------

    def loaded(self, result: LoadResult) -> None:
        """A copy finished (``LoadResult`` from ``RunnerOutput.lora_loads``)."""
        key = result.key
        if self._loading.get(key) != result.generation:
            return  # not a load in flight (a stale report)
        del self._loading[key]
        entry = self._entries.get(key)
        if entry is None:  # removed while it loaded: its pages are free only now
            self.pool.evict(key, count=False)
            return
        if result.error is not None:
            self.pool.evict(key, count=False)
            self._fail(key, result.error)
            return
        self.pool.mark_ready(key)
        self.stats.slot_loads += 1
        self.stats.load_bytes += entry.nbytes
        if result.from_disk:
            self.stats.disk_loads += 1
            self._put_host(key)

    def _fail(self, key: str, cause: str) -> None:
        self.stats.load_failures += 1
        self._failed[key] = f"adapter {self.name_of(key)!r} could not be loaded: {cause}"
        self._waiting_pages.discard(key)

    def _put_host(self, key: str) -> None:
        self._host[key] = None
        self._host.move_to_end(key)
        while len(self._host) > self.max_cpu_loras:
            victim = next((k for k in self._host if k not in self._pinned), None)
            if victim is None:
                break  # everything pinned: exceed the limit rather than drop a pinned adapter
            del self._host[victim]
            self._drop_host.append(victim)
            self.stats.host_evictions += 1

    # ---- views -----------------------------------------------------------------------------

    @property
    def loads_in_flight(self) -> int:
        return len(self._loading)

    def tier_of(self, key: str) -> str:
        """device | loading | host | disk | failed | none."""
        res = self.pool.get(key)
        if res is not None and key in self._entries:
            return "device" if res.state == "ready" else "loading"
        if key in self._failed:
            return "failed"
        if key in self._host:
            return "host"
        return "disk" if key in self._entries else "none"

    def tiers(self) -> dict[str, Tier]:
        """Every registered adapter: content hash -> device | host | disk (loading and failed
        adapters count where their weights are: host or disk)."""
        out: dict[str, Tier] = {}
        for key in self._entries:
            if self.pool.is_ready(key):
                out[key] = "device"
            else:
                out[key] = "host" if key in self._host else "disk"
        return out

    def failed(self) -> dict[str, str]:
        return dict(self._failed)

    def counts(self) -> dict[str, int]:
        ready = sum(1 for k in self.pool.resident() if self.pool.is_ready(k) and k in self._entries)
        return {"device": ready, "host": len(self._host), "registered": len(self._entries)}

    def resident(self) -> list[Residency]:
        return [r for k in self.pool.resident() if (r := self.pool.get(k)) is not None]

    def adapter_bytes(self) -> int:
        """The real size of the weights the pool holds (ready and loading)."""
        return sum(e.nbytes for k in self.pool.resident() if (e := self._entries.get(k)))

    def tenant_pages(self) -> dict[Tenant, int]:
        """Pool pages per tenant that caused the residency."""
        used: Counter[Tenant] = Counter()
        for res in self.resident():
            entry = self._entries.get(res.key)
            used[entry.tenant if entry else None] += sum(len(p) for p in res.pages.values())
        return dict(used)
