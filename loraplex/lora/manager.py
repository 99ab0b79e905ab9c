"""The adapter cache: disk -> host (LRU, pinnable) -> the device page pool.

* disk: every added adapter's source path, so an adapter evicted from host memory can come back;
* host: up to ``max_cpu_loras`` parsed adapters (``LoRAAdapter``), least recently used evicted
  first, pinned ones never;
* device: one page pool per target module (``loraplex.lora.pool``), sized by ``lora_memory``;
  each resident adapter holds exactly its rank's pages. A step's adapters are named by slot
  (``LoRASlots``, at most ``max_loras`` a step); ``activate`` points each slot's page-index row
  at its adapter's pages, which copies nothing.

Loads are asynchronous: the scheduler asks ``ensure_resident`` before admitting a request; a
miss reserves pages (evicting least recently used adapters with no running request, never a
pinned one) and a background thread copies the weights (on CUDA from pinned host memory on a
copy stream), so no step waits on a copy. ``stats.load_waits`` counts the steps that did.

Adapters are identified by their content hash everywhere in the engine.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

from loraplex.config import LoRAConfig
from loraplex.kernels.lora_weights import LoRALayerWeights
from loraplex.kernels.meta import LoRAKernelMeta
from loraplex.lora.adapter import BaseModelInfo, LoRAAdapter, load_adapter
from loraplex.lora.errors import AdapterError
from loraplex.lora.layers import LoRALinear, LoRAStep
from loraplex.lora.pool import AdapterPool, PoolFullError, Residency
from loraplex.lora.replica import ClearSlot, FillPages, ForgetAdapter, PoolEvent, SetSlot

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoRAStats:
    disk_loads: int = 0  # adapters parsed from disk (added, or reloaded after host eviction)
    host_hits: int = 0  # device loads served from host memory
    host_evictions: int = 0
    slot_loads: int = 0  # adapters copied into the device pool
    slot_hits: int = 0  # steps that found their adapter resident and in its slot already
    load_waits: int = 0  # steps that had to wait for an adapter copy (the scheduler avoids it)
    load_bytes: int = 0  # bytes copied into the pool
    # Evictions and deferred loads are the pool's to count (``pool.counters``).


class LoRAModel(Protocol):
    """What the manager needs of a model (the engine's ``LlamaForCausalLM`` family): its
    decoder layers (``model.model.layers``) and the linears of a layer LoRA wraps, each with
    the checkpoint modules it packs (``lora_targets``, declared on the model class)."""

    @property
    def model(self) -> _Decoder: ...

    def lora_targets(self) -> dict[str, list[str]]: ...


class _Decoder(Protocol):
    @property
    def layers(self) -> nn.ModuleList: ...


@dataclass(frozen=True)
class PoolGeometry:
    """The pool's shape: pages per module and what one page of each module costs."""

    pages_per_module: int
    page_bytes: dict[str, int]  # module -> bytes of one page (A and B rows in every layer)

    @property
    def bytes_total(self) -> int:
        return self.pages_per_module * sum(self.page_bytes.values())


class LoRAManager:
    def __init__(
        self,
        model: LoRAModel,
        hf_config: Any,
        config: LoRAConfig,
        max_num_tokens: int,
        device: torch.device,
    ) -> None:
        self.config = config
        self.device = device
        self.base_info = BaseModelInfo.from_hf_config(hf_config)
        self.step = LoRAStep()
        self.meta = LoRAKernelMeta(max_num_tokens, config.max_loras, device)
        self.layers: list[tuple[int, LoRALinear]] = []
        # Which linears to wrap, and what each packs, is the model class's to say.
        targets = model.lora_targets()
        for i, layer in enumerate(model.model.layers):
            for path, names in targets.items():
                parent_name, _, attr = path.rpartition(".")
                parent = layer.get_submodule(parent_name)
                wrapped = LoRALinear(getattr(parent, attr), names, self.step)
                setattr(parent, attr, wrapped)
                self.layers.append((i, wrapped))
        # The checkpoint modules an adapter may target on this model, in layer order: the
        # modules of one linear are consecutive, so a linear's page index is a slice.
        self.target_modules = tuple(m for names in targets.values() for m in names)
        self._module_index = {m: k for k, m in enumerate(self.target_modules)}
        self.num_layers = len(model.model.layers)
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._sources: dict[str, Path] = {}
        self._names: dict[str, str] = {}  # key -> name (for logs and stats)
        self._ranks: dict[str, dict[str, int]] = {}  # key -> module -> rank (largest over layers)
        self._sizes: dict[str, int] = {}  # key -> its weights' bytes at the pool's dtype
        self._pinned: set[str] = set()
        self.stats = LoRAStats()
        self.geometry: PoolGeometry | None = None
        self.pool: AdapterPool | None = None
        self._pages: torch.Tensor | None = None  # [M, max_loras, max_rank] int32
        self._slot_ranks: torch.Tensor | None = None  # [M, max_loras] int32
        self._slot_state: list[tuple[str, int] | None] = [None] * config.max_loras
        self._loads: dict[str, Future[LoRAAdapter | None]] = {}
        self._failed: dict[str, BaseException] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._copy_stream: Any = None
        model_dtype = self.layers[0][1].base.weight.dtype
        self.dtype: torch.dtype = (
            model_dtype if config.lora_dtype == "auto" else _DTYPES[config.lora_dtype]
        )  # the pool's storage type
        # Tensor parallelism, rank 0: every pool decision, for the other ranks to replay
        # (``lora/replica.py``); None: not recorded.
        self.events: list[PoolEvent] | None = None
        self._replica_failed: dict[str, str] = {}  # other ranks: adapters whose fill failed

    # ---- the pool --------------------------------------------------------------------------

    def _dims(self) -> dict[str, tuple[int, int]]:
        """module -> (in_features, out_features) of its slice."""
        dims: dict[str, tuple[int, int]] = {}
        for _, layer in self.layers:
            for name, size in zip(layer.module_names, layer.sizes, strict=True):
                dims.setdefault(name, (layer.in_features, size))
        return dims

    def plan_pool(self, kv_cache_bytes: int | None = None) -> PoolGeometry:
        """Pages per module from ``lora_memory`` (bytes, or a fraction of the KV cache's bytes;
        None: room for ``max_loras`` adapters at ``max_lora_rank``)."""
        esize = self.dtype.itemsize
        page_bytes = {m: self.num_layers * (i + o) * esize for m, (i, o) in self._dims().items()}
        per_page_set = sum(page_bytes.values())
        budget = self.config.lora_memory
        if budget is None:
            pages = self.config.max_loras * self.config.max_lora_rank
        else:
            if isinstance(budget, float):
                if kv_cache_bytes is None:
                    raise ValueError("lora_memory as a fraction needs the KV cache's size")
                budget = int(budget * kv_cache_bytes)
            pages = budget // per_page_set
        if pages < 1:
            raise ValueError(
                f"lora_memory {self.config.lora_memory!r} holds no page: one rank-row of every "
                f"target module takes {per_page_set} bytes on this model; raise --lora-memory"
            )
        return PoolGeometry(pages, page_bytes)

    def kv_share(self, budget: int) -> int:
        """What is left of ``budget`` bytes for the KV cache once the pool has its share."""
        mem = self.config.lora_memory
        if isinstance(mem, float):
            return int(budget / (1.0 + mem))  # pool = mem * KV, pool + KV = budget
        return budget - self.plan_pool().bytes_total

    def allocate_pool(self, kv_cache_bytes: int | None = None) -> PoolGeometry:
        """Allocate the pool (zeroed) and bind every LoRA layer to it. Called once."""
        if self.pool is not None:
            raise RuntimeError("the adapter pool is already allocated")
        geo = self.plan_pool(kv_cache_bytes)
        P, M, cfg = geo.pages_per_module, len(self.target_modules), self.config
        i32 = torch.int32
        self._pages = torch.zeros(
            M, cfg.max_loras, cfg.max_lora_rank, dtype=i32, device=self.device
        )
        self._slot_ranks = torch.zeros(M, cfg.max_loras, dtype=i32, device=self.device)
        for _, layer in self.layers:
            dev = layer.base.weight.device
            m0 = self._module_index[layer.module_names[0]]
            S = len(layer.module_names)
            layer.bind(
                LoRALayerWeights(
                    lora_a=tuple(
                        torch.zeros(P, layer.in_features, dtype=self.dtype, device=dev)
                        for _ in range(S)
                    ),  # per slice [P, in]
                    lora_b=tuple(
                        torch.zeros(P, n, dtype=self.dtype, device=dev) for n in layer.sizes
                    ),  # per slice [P, n_j]
                    pages=self._pages[m0 : m0 + S],
                    ranks=self._slot_ranks[m0 : m0 + S],
                    slice_offsets=tuple(layer.offsets),
                )
            )
        self.geometry = geo
        self.pool = AdapterPool(
            {m: P for m in self.target_modules}, pinned=self._pinned, on_evict=self._on_evict
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(device=self.device)
        logger.info("adapter pool: %d pages per module, %.1f MiB", P, geo.bytes_total / 2**20)
        return geo

    def _require_pool(self) -> AdapterPool:
        if self.pool is None:
            self.allocate_pool()
        assert self.pool is not None
        return self.pool

    # ---- registry --------------------------------------------------------------------------

    def add_adapter(self, source: str | Path, name: str, pinned: bool = False) -> LoRAAdapter:
        """Load and validate an adapter (``AdapterError`` if it is bad) and keep it in host memory.
        A pinned adapter is loaded into the device pool at once and never evicted from it."""
        adapter = load_adapter(
            source, self.base_info, max_rank=self.config.max_lora_rank, name=name
        )
        key = adapter.content_hash
        ranks = self._module_ranks(adapter)
        pool = self._require_pool()
        try:
            pool.check_fits(ranks)
        except PoolFullError as exc:
            raise AdapterError(
                "pool_too_small",
                f"adapter {name!r} does not fit the device adapter pool: {exc}; raise "
                "--lora-memory",
            ) from exc
        if self.dtype == torch.float16:
            self._check_half_range(adapter)
        self.stats.disk_loads += 1
        self._sources[key] = Path(source)
        self._names[key] = name
        self._ranks[key] = ranks
        esize = self.dtype.itemsize
        self._sizes[key] = sum(
            (a.shape[0] * (a.shape[1] + b.shape[0])) * esize for a, b in adapter.weights.values()
        )
        self._put_host(key, adapter)
        if pinned:
            self.pin(key)
        return adapter

    def _check_half_range(self, adapter: LoRAAdapter) -> None:
        """A float16 pool cannot hold values beyond +-65504 (B with its scaling folded in)."""
        limit = torch.finfo(torch.float16).max
        for (layer, module), (a, b) in adapter.weights.items():
            big = max(
                float(a.abs().max()), float(b.abs().max()) * adapter.scaling_of(layer, module)
            )
            if big > limit:
                raise AdapterError(
                    "bad_dtype",
                    f"adapter {adapter.name!r} has a weight of magnitude {big:.3g} in layer "
                    f"{layer} {module}, beyond float16's range; serve it with --lora-dtype "
                    "bfloat16 or float32",
                )

    def _module_ranks(self, adapter: LoRAAdapter) -> dict[str, int]:
        ranks: dict[str, int] = {}
        for (_, module), (a, _) in adapter.weights.items():
            ranks[module] = max(ranks.get(module, 0), int(a.shape[0]))
        return ranks

    def remove_adapter(self, key: str) -> None:
        """Forget ``key`` (the caller made sure no request uses it)."""
        self._wait_load(key)
        self._host.pop(key, None)
        self._sources.pop(key, None)
        self._names.pop(key, None)
        self._ranks.pop(key, None)
        self._sizes.pop(key, None)
        self._failed.pop(key, None)
        self._pinned.discard(key)
        if self.pool is not None:
            self.pool.evict(key, count=False)
        self._record(ForgetAdapter(key))

    def has_adapter(self, key: str) -> bool:
        return key in self._sources

    def pin(self, key: str, pinned: bool = True) -> None:
        """Keep ``key`` in the device pool (loaded now) or let it be evicted again."""
        if not pinned:
            self._pinned.discard(key)
            return
        self._pinned.add(key)
        if key in self._sources and not self._require_pool().is_ready(key):
            self._load_now(key, count_wait=False)

    def _put_host(self, key: str, adapter: LoRAAdapter) -> None:
        self._host[key] = adapter
        self._host.move_to_end(key)
        while len(self._host) > self.config.max_cpu_loras:
            victim = next((k for k in self._host if k not in self._pinned), None)
            if victim is None:
                break  # everything pinned: exceed the limit rather than drop a pinned adapter
            del self._host[victim]
            self.stats.host_evictions += 1

    def _read_disk(self, key: str) -> LoRAAdapter:
        """Parse ``key`` from its source again (safe off the engine thread: no shared state)."""
        source = self._sources.get(key)
        if source is None:
            raise KeyError(f"adapter {key[:12]} is not registered with the engine")
        adapter = load_adapter(
            source, self.base_info, max_rank=self.config.max_lora_rank, name=self._names[key]
        )
        if adapter.content_hash != key:
            raise ValueError(
                f"adapter {self._names[key]!r} changed on disk at {source} since it was added; "
                "add it again to serve the new weights"
            )
        return adapter

    # ---- residency -------------------------------------------------------------------------

    def tier_of(self, key: str) -> Literal["device", "host", "disk", "none"]:
        if self.pool is not None and self.pool.is_ready(key):
            return "device"
        if key in self._host:
            return "host"
        return "disk" if key in self._sources else "none"

    def tiers(self) -> dict[str, Literal["device", "host", "disk"]]:
        """Every adapter registered with the engine: content hash -> device | host | disk."""
        out: dict[str, Literal["device", "host", "disk"]] = {}
        for key in self._sources:
            tier = self.tier_of(key)
            if tier != "none":
                out[key] = tier
        return out

    def residency(self) -> dict[str, int]:
        ready = 0 if self.pool is None else sum(map(self.pool.is_ready, self.pool.resident()))
        return {"device": ready, "host": len(self._host), "disk": len(self._sources)}

    def pool_usage(self) -> dict[str, int]:
        """Pages and bytes of the device pool, and the real size of what it holds."""
        if self.pool is None or self.geometry is None:
            return dict.fromkeys(
                ("pages", "pages_used", "bytes", "bytes_used", "adapter_bytes", "loading"), 0
            )
        geo, pool = self.geometry, self.pool
        used = pool.pages_used_by_module()
        return {
            "pages": pool.pages_total(),
            "pages_used": sum(used.values()),
            "bytes": geo.bytes_total,
            "bytes_used": sum(n * geo.page_bytes[m] for m, n in used.items()),
            "adapter_bytes": sum(self._sizes.get(k, 0) for k in pool.resident()),
            "loading": len(self._loads),
        }

    def ensure_resident(self, key: str, in_use: Callable[[str], bool]) -> bool:
        """Whether a request on ``key`` may run now; if its adapter is not in the device pool,
        start loading it (asynchronously) and say no. ``in_use(k)``: whether adapter ``k`` has
        running requests (those are never evicted)."""
        pool = self._require_pool()
        self.poll()
        if pool.is_ready(key):
            pool.touch(key)
            return True
        if key in self._loads:
            return False
        if key in self._failed or key not in self._sources:
            return True  # activate() raises the error for the step, as a synchronous load would
        res = pool.reserve(key, self._ranks[key], in_use)
        if res is None:  # counted by the pool as deferred
            return False
        self._record(FillPages(key, res.pages))
        adapter = self._host.get(key)
        if adapter is not None:
            self._host.move_to_end(key)
            self.stats.host_hits += 1
        assert self._executor is not None
        self._loads[key] = self._executor.submit(self._load_job, key, adapter, res)
        return False

    def poll(self) -> None:
        """Finish the loads whose copies are done (on the engine thread)."""
        for key in [k for k, f in self._loads.items() if f.done()]:
            self._finish(key, self._loads.pop(key))

    def _finish(self, key: str, future: Future[LoRAAdapter | None]) -> None:
        pool = self.pool
        assert pool is not None
        exc = future.exception()
        if exc is not None or key not in self._sources:  # failed, or removed meanwhile
            pool.evict(key, count=False)
            if exc is not None:
                logger.warning("loading adapter %s failed: %s", self._names.get(key, key), exc)
                self._failed[key] = exc
            return
        parsed = future.result()
        if parsed is not None:  # it came from disk
            self.stats.disk_loads += 1
            self._put_host(key, parsed)
        pool.mark_ready(key)
        self.stats.slot_loads += 1
        res = pool.get(key)
        assert res is not None and self.geometry is not None
        self.stats.load_bytes += sum(
            len(p) * self.geometry.page_bytes[m] for m, p in res.pages.items()
        )

    def _wait_load(self, key: str) -> None:
        future = self._loads.pop(key, None)
        if future is not None:
            future.exception()  # wait
            self._finish(key, future)

    def _load_job(
        self, key: str, adapter: LoRAAdapter | None, res: Residency
    ) -> LoRAAdapter | None:
        """Copy ``key``'s weights into its reserved pages (the loader thread). Returns the adapter
        when it had to be parsed from disk, for the engine thread to cache."""
        parsed = None
        if adapter is None:
            adapter = parsed = self._read_disk(key)
        if self._copy_stream is not None:
            with torch.cuda.stream(self._copy_stream):
                self._fill(adapter, res, pin=True)
            self._copy_stream.synchronize()
        else:
            self._fill(adapter, res, pin=False)
        return parsed

    def _fill(self, adapter: LoRAAdapter, res: Residency, pin: bool) -> None:
        rows = {
            m: torch.tensor(p, dtype=torch.int64).to(self.device, non_blocking=pin)
            for m, p in res.pages.items()
        }  # module -> [r] pool rows
        for i, layer in self.layers:
            for j, module in enumerate(layer.module_names):
                if module not in rows:
                    continue
                ab = adapter.weights.get((i, module))
                a = b = None
                scaling = 1.0
                if ab is not None:
                    a, b = ab
                    if pin:
                        a = a.pin_memory().to(self.device, non_blocking=True)
                        b = b.pin_memory().to(self.device, non_blocking=True)
                    scaling = adapter.scaling_of(i, module)
                    a, b = layer.base.shard_lora(module, a, b)  # this rank's share
                layer.write_rows(j, rows[module], a, b, scaling)

    def _load_now(
        self, key: str, busy: set[str] | None = None, count_wait: bool = True
    ) -> Residency:
        """Make ``key`` resident before returning (a step that must wait for it, or a pin);
        adapters in ``busy`` or in a slot are not evicted for it."""
        pool = self._require_pool()
        if count_wait:
            self.stats.load_waits += 1
        self._wait_load(key)
        if key in self._failed:
            raise self._failed.pop(key)
        if not pool.is_ready(key):
            if key not in self._sources:
                raise KeyError(f"adapter {key[:12]} is not registered with the engine")
            keep = set(self._slot_keys()) | (busy or set())
            res = pool.reserve(key, self._ranks[key], keep.__contains__)
            if res is None:
                raise RuntimeError(
                    f"the adapter pool has no room for {self._names[key]!r}: every resident "
                    "adapter is in use or pinned; raise --lora-memory or lower --max-loras"
                )
            self._record(FillPages(key, res.pages))
            adapter = self._host.get(key)
            self._finish(key, _done(self._load_job(key, adapter, res)))
        res = pool.get(key)
        assert res is not None
        return res

    def _slot_keys(self) -> list[str]:
        return [s[0] for s in self._slot_state if s is not None]

    def _on_evict(self, key: str) -> None:
        """``key`` left the pool: no slot may point at its pages any more."""
        for slot, state in enumerate(self._slot_state):
            if state is not None and state[0] == key:
                self._clear_slot(slot)

    def _clear_slot(self, slot: int) -> None:
        assert self._slot_ranks is not None
        self._record(ClearSlot(slot))
        self._slot_ranks[:, slot] = 0
        self._slot_state[slot] = None
        for _, layer in self.layers:
            if layer.weights is not None:
                layer.weights.invalidate(slot)

    def activate(self, lora_slots: dict[int, str]) -> None:
        """Point each slot's page-index row at its adapter's pages for this step."""
        pool = self._require_pool()
        self.poll()
        for slot, key in lora_slots.items():
            res = pool.get(key)
            if res is None or res.state != "ready":
                res = self._load_now(key, set(lora_slots.values()))
            pool.touch(key)
            if self._slot_state[slot] == (key, res.generation):
                self.stats.slot_hits += 1
                continue
            self._write_slot(slot, res)

    def _write_slot(self, slot: int, res: Residency) -> None:
        assert self._pages is not None and self._slot_ranks is not None
        M, R = self._pages.shape[0], self._pages.shape[2]
        pages = torch.zeros(M, R, dtype=torch.int32)  # [M, max_rank]
        ranks = torch.zeros(M, dtype=torch.int32)  # [M]
        for module, rows in res.pages.items():
            k = self._module_index[module]
            pages[k, : len(rows)] = torch.tensor(rows, dtype=torch.int32)
            ranks[k] = len(rows)
        self._pages[:, slot].copy_(pages)
        self._slot_ranks[:, slot].copy_(ranks)
        self._slot_state[slot] = (res.key, res.generation)
        for _, layer in self.layers:
            assert layer.weights is not None
            layer.weights.invalidate(slot)
        self._record(SetSlot(slot, res.key, res.generation, res.pages))

    # ---- tensor parallelism: rank 0 records, the other ranks replay --------------------------

    def _record(self, event: PoolEvent) -> None:
        if self.events is not None:
            self.events.append(event)

    def take_events(self) -> list[PoolEvent]:
        """The decisions recorded since the last call (rank 0), oldest first."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events

    def replay(self, event: PoolEvent) -> None:
        """Apply one of rank 0's decisions to this rank's pool (its share of each adapter, read
        from this rank's host cache or from disk). A fill that fails here is fatal only when a
        slot later points at it: rank 0 failed it too, unless the file changed between reads."""
        self._require_pool()
        if isinstance(event, FillPages):
            res = Residency(event.key, {m: list(p) for m, p in event.pages.items()})
            try:
                parsed = self._load_job(event.key, self._host.get(event.key), res)
            except Exception as exc:
                self._replica_failed[event.key] = f"{type(exc).__name__}: {exc}"
                return
            self._replica_failed.pop(event.key, None)
            if parsed is not None:
                self._put_host(event.key, parsed)
        elif isinstance(event, SetSlot):
            why = self._replica_failed.get(event.key)
            if why is not None:
                raise RuntimeError(
                    f"adapter {self._names.get(event.key, event.key[:12])!r} could not be "
                    f"loaded on this tensor-parallel rank ({why}) but rank 0 uses it"
                )
            self._write_slot(
                event.slot, Residency(event.key, dict(event.pages), "ready", event.generation)
            )
        elif isinstance(event, ClearSlot):
            self._clear_slot(event.slot)
        else:
            self.remove_adapter(event.key)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _done(value: LoRAAdapter | None) -> Future[LoRAAdapter | None]:
    future: Future[LoRAAdapter | None] = Future()
    future.set_result(value)
    return future
