"""The adapter store of the runner: LoRA layers, the device page pool's tensors, parsed adapters
in host memory, and the copies residency orders.

It decides nothing: ``engine/adapter_residency.py`` (torch-free, owned by the scheduler) says
which adapter goes into which pages and which host copies to drop (``AdapterPlan`` in
``SchedulerOutput``); this store carries the plan out. A copy runs on a background thread (on
CUDA from pinned host memory on a copy stream), so no step waits on one; its outcome comes back
as a ``LoadResult`` (``poll``) for residency, with the error as a sentence when it failed (file
missing, changed, corrupt, NaN weights, an exception in the copy): the step never raises for an
adapter's fault. Pointing a slot at its adapter's pages (``apply``) writes one page-index row
and copies no weight.

Adapters are identified by their content hash everywhere in the engine.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from loraplex.config import LoRAConfig
from loraplex.kernels.lora_weights import LoRALayerWeights
from loraplex.kernels.meta import LoRAKernelMeta
from loraplex.lora.adapter import BaseModelInfo, LoRAAdapter, load_adapter
from loraplex.lora.errors import AdapterError
from loraplex.lora.layers import LoRALinear, LoRAStep
from loraplex.lora.plan import AdapterPlan, LoadOrder, LoadResult, SlotBinding
from loraplex.lora.replica import FillPages, ForgetAdapter, PoolEvent, SetSlot

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StoreStats:
    adds: int = 0  # adapters parsed and validated when added
    slot_hits: int = 0  # slots in use by a step that already pointed at their adapter


@dataclass(frozen=True)
class Registered:
    """What residency needs of an added adapter."""

    key: str  # content hash
    ranks: dict[str, int]  # module -> rank (largest over layers)
    nbytes: int  # its weights at the pool's dtype


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
        self._host: dict[str, LoRAAdapter] = {}  # parsed copies residency keeps in host memory
        self._sources: dict[str, Path] = {}
        self._names: dict[str, str] = {}  # key -> name (for messages)
        self.stats = StoreStats()
        self.geometry: PoolGeometry | None = None
        self._pages: torch.Tensor | None = None  # [M, max_loras, max_rank] int32
        self._slot_ranks: torch.Tensor | None = None  # [M, max_loras] int32
        self._slot_state: list[tuple[str, int] | None] = [None] * config.max_loras
        self._loads: dict[str, tuple[int, Future[LoRAAdapter | None]]] = {}  # key -> (gen, copy)
        self._done = threading.Condition()  # notified when a copy finishes
        self._executor: ThreadPoolExecutor | None = None
        self._copy_stream: Any = None
        model_dtype = self.layers[0][1].base.weight.dtype
        self.dtype: torch.dtype = (
            model_dtype if config.lora_dtype == "auto" else _DTYPES[config.lora_dtype]
        )  # the pool's storage type
        # Tensor parallelism, rank 0: every pool change, for the other ranks to replay
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
        if self.geometry is not None:
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
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(device=self.device)
        logger.info("adapter pool: %d pages per module, %.1f MiB", P, geo.bytes_total / 2**20)
        return geo

    @property
    def allocated(self) -> bool:
        return self.geometry is not None

    def pages_per_module(self) -> dict[str, int]:
        """Each target module's pool size in pages (allocating the pool if it is not yet)."""
        geo = self.geometry or self.allocate_pool()
        return dict.fromkeys(self.target_modules, geo.pages_per_module)

    # ---- adding and removing ---------------------------------------------------------------

    def add_adapter(self, source: str | Path, name: str) -> tuple[LoRAAdapter, Registered]:
        """Parse and validate an adapter (``AdapterError`` if it is bad) and keep it in host
        memory; residency decides from then on where it lives."""
        adapter = load_adapter(
            source, self.base_info, max_rank=self.config.max_lora_rank, name=name
        )
        key = adapter.content_hash
        ranks = self._module_ranks(adapter)
        per_module = self.pages_per_module()
        for module, r in ranks.items():
            if r > per_module.get(module, 0):
                raise AdapterError(
                    "pool_too_small",
                    f"adapter {name!r} does not fit the device adapter pool: rank {r} in "
                    f"{module} needs {r} pages; the pool has {per_module.get(module, 0)} per "
                    "module; raise --lora-memory",
                )
        if self.dtype == torch.float16:
            self._check_half_range(adapter)
        self.stats.adds += 1
        self._sources[key] = Path(source)
        self._names[key] = name
        self._host[key] = adapter
        esize = self.dtype.itemsize
        nbytes = sum(
            (a.shape[0] * (a.shape[1] + b.shape[0])) * esize for a, b in adapter.weights.values()
        )
        return adapter, Registered(key, ranks, nbytes)

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

    def has_adapter(self, key: str) -> bool:
        return key in self._sources

    def forget(self, key: str) -> None:
        """Drop ``key``'s source and host copy (a copy in flight finishes; its result is
        reported and residency ignores it)."""
        self._host.pop(key, None)
        self._sources.pop(key, None)
        self._names.pop(key, None)
        self._record(ForgetAdapter(key))

    def host_keys(self) -> list[str]:
        return list(self._host)

    # ---- carrying out residency's plan -----------------------------------------------------

    def apply(self, plan: AdapterPlan) -> None:
        """Drop host copies, start the ordered copies, point the step's slots at their pages."""
        for key in plan.drop_host:
            self._host.pop(key, None)
        for order in plan.loads:
            self.start_load(order)
        for slot, binding in plan.slots.items():
            if self._slot_state[slot] == (binding.key, binding.generation):
                self.stats.slot_hits += 1
                continue
            self._write_slot(slot, binding)

    def start_load(self, order: LoadOrder) -> None:
        """Copy ``order.key`` into its pages on the loader thread (``poll`` reports it)."""
        if self._executor is None:
            raise RuntimeError("allocate the adapter pool before loading adapters")
        self._record(FillPages(order.key, order.pages))
        adapter = self._host.get(order.key)
        future = self._executor.submit(self._load_job, order, adapter)
        future.add_done_callback(self._notify)
        self._loads[order.key] = (order.generation, future)

    def load_now(self, order: LoadOrder) -> LoadResult:
        """The same copy, on this thread (a pinned adapter, loaded when it is added)."""
        self.start_load(order)
        _, future = self._loads.pop(order.key)
        future.exception()  # wait
        return self._result(order.key, order.generation, future)

    def _notify(self, _: object) -> None:
        with self._done:
            self._done.notify_all()

    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    def poll(self, timeout: float = 0.0) -> list[LoadResult]:
        """The copies finished since the last call; with ``timeout``, wait up to that long for
        one when copies are in flight and none has finished (an idle step: never a spin)."""
        if timeout > 0 and self._loads and not any(f.done() for _, f in self._loads.values()):
            with self._done:
                self._done.wait_for(
                    lambda: any(f.done() for _, f in list(self._loads.values())), timeout
                )
        results: list[LoadResult] = []
        for key in [k for k, (_, f) in self._loads.items() if f.done()]:
            generation, future = self._loads.pop(key)
            results.append(self._result(key, generation, future))
        return results

    def _result(self, key: str, generation: int, future: Future[LoRAAdapter | None]) -> LoadResult:
        exc = future.exception()
        if exc is not None:
            logger.warning("loading adapter %s failed: %s", self._names.get(key, key[:12]), exc)
            return LoadResult(key, generation, error=_cause(exc))
        parsed = future.result()
        if parsed is not None and key in self._sources:  # parsed from disk: keep it in host
            self._host[key] = parsed
        return LoadResult(key, generation, from_disk=parsed is not None)

    def _read_disk(self, key: str) -> LoRAAdapter:
        """Parse ``key`` from its source again (safe off the engine thread: no shared state)."""
        source = self._sources.get(key)
        name = self._names.get(key, key[:12])
        if source is None:
            raise KeyError(f"adapter {key[:12]} is not registered with the engine")
        adapter = load_adapter(
            source, self.base_info, max_rank=self.config.max_lora_rank, name=name
        )
        if adapter.content_hash != key:
            raise AdapterChanged(
                f"its files changed on disk since it was added (content hash "
                f"{adapter.content_hash[:12]}, expected {key[:12]})"
            )
        return adapter

    def _load_job(self, order: LoadOrder, adapter: LoRAAdapter | None) -> LoRAAdapter | None:
        """Copy the adapter into its pages (the loader thread). Returns the adapter when it had
        to be parsed from disk, for the engine thread to keep in host memory."""
        parsed = None
        if adapter is None:
            adapter = parsed = self._read_disk(order.key)
        _check_finite(adapter)
        if self._copy_stream is not None:
            with torch.cuda.stream(self._copy_stream):
                self._fill(adapter, order.pages, pin=True)
            self._copy_stream.synchronize()
        else:
            self._fill(adapter, order.pages, pin=False)
        return parsed

    def _fill(self, adapter: LoRAAdapter, pages: dict[str, list[int]], pin: bool) -> None:
        rows = {
            m: torch.tensor(p, dtype=torch.int64).to(self.device, non_blocking=pin)
            for m, p in pages.items()
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

    def _write_slot(self, slot: int, binding: SlotBinding) -> None:
        assert self._pages is not None and self._slot_ranks is not None
        M, R = self._pages.shape[0], self._pages.shape[2]
        pages = torch.zeros(M, R, dtype=torch.int32)  # [M, max_rank]
        ranks = torch.zeros(M, dtype=torch.int32)  # [M]
        for module, rows in binding.pages.items():
            k = self._module_index[module]
            pages[k, : len(rows)] = torch.tensor(rows, dtype=torch.int32)
            ranks[k] = len(rows)
        self._pages[:, slot].copy_(pages)
        self._slot_ranks[:, slot].copy_(ranks)
        self._slot_state[slot] = (binding.key, binding.generation)
        for _, layer in self.layers:
            assert layer.weights is not None
            layer.weights.invalidate(slot)
        self._record(SetSlot(slot, binding.key, binding.generation, binding.pages))

    # ---- tensor parallelism: rank 0 records, the other ranks replay --------------------------

    def _record(self, event: PoolEvent) -> None:
        if self.events is not None:
            self.events.append(event)

    def take_events(self) -> list[PoolEvent]:
        """The changes recorded since the last call (rank 0), oldest first."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events

    def replay(self, event: PoolEvent) -> None:
        """Apply one of rank 0's changes to this rank's pool (its share of each adapter, read
        from this rank's host cache or from disk). A fill that fails here is fatal only when a
        slot later points at it: rank 0 failed it too, unless the file changed between reads."""
        if isinstance(event, FillPages):
            order = LoadOrder(event.key, 0, {m: list(p) for m, p in event.pages.items()})
            try:
                parsed = self._load_job(order, self._host.get(event.key))
            except Exception as exc:
                self._replica_failed[event.key] = f"{type(exc).__name__}: {exc}"
                return
            self._replica_failed.pop(event.key, None)
            if parsed is not None:
                self._host[event.key] = parsed
        elif isinstance(event, SetSlot):
            why = self._replica_failed.get(event.key)
            if why is not None:
                raise RuntimeError(
                    f"adapter {self._names.get(event.key, event.key[:12])!r} could not be "
                    f"loaded on this tensor-parallel rank ({why}) but rank 0 uses it"
                )
            self._write_slot(
                event.slot, SlotBinding(event.slot, event.key, event.generation, event.pages)
            )
        elif isinstance(event, ForgetAdapter):
            self.forget(event.key)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class AdapterChanged(ValueError):
    """An adapter's files no longer hold the content it was added with."""


def _check_finite(adapter: LoRAAdapter) -> None:
    for (layer, module), (a, b) in adapter.weights.items():
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            raise AdapterError(
                "nan_weights",
                f"its weights hold NaN or Inf values (layer {layer} {module})",
            )


def _cause(exc: BaseException) -> str:
    """A load failure as a sentence for the client: the cause, no paths or internals."""
    if isinstance(exc, AdapterChanged):
        return str(exc)
    if isinstance(exc, AdapterError):  # its stored files no longer pass the upload's checks
        if exc.code == "missing_file":
            return "its files are missing from the server's storage"
        if exc.code == "nan_weights":
            return "its weights hold NaN or Inf values"
        return f"its stored files are damaged ({exc.code})"
    if isinstance(exc, FileNotFoundError | NotADirectoryError):
        return "its files are missing from the server's storage"
    if isinstance(exc, PermissionError):
        return "its files cannot be read on the server"
    if isinstance(exc, MemoryError):
        return "the server ran out of memory while loading it"
    if isinstance(exc, OSError):
        return f"its files could not be read on the server ({type(exc).__name__})"
    return f"the copy into the adapter pool failed ({type(exc).__name__})"
