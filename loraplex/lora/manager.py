"""The adapter cache: disk -> host (LRU, pinnable) -> device slots.

* disk: every added adapter's source path, so an adapter evicted from host memory can come back;
* host: up to ``max_cpu_loras`` parsed adapters (``LoRAAdapter``), least recently used evicted
  first, pinned ones never;
* device: ``max_loras`` slots in every LoRA layer's stacks. The scheduler decides which adapter
  holds which slot (``LoRASlots``); ``activate`` copies weights only when a slot's adapter changed.

Adapters are identified by their content hash everywhere in the engine.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

from loraplex.config import LoRAConfig
from loraplex.kernels.meta import LoRAKernelMeta
from loraplex.lora.adapter import BaseModelInfo, LoRAAdapter, load_adapter
from loraplex.lora.layers import LoRALinear, LoRAStep

logger = logging.getLogger(__name__)


@dataclass
class LoRAStats:
    disk_loads: int = 0  # adapters parsed from disk (added, or reloaded after host eviction)
    host_hits: int = 0  # slot loads served from host memory
    host_evictions: int = 0
    slot_loads: int = 0  # adapters copied into a device slot
    slot_hits: int = 0  # steps that found their adapter already in its slot
    slot_evictions: int = 0  # slot loads that replaced another adapter


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
        # The checkpoint modules an adapter may target on this model, in layer order.
        self.target_modules = tuple(m for names in targets.values() for m in names)
        self._allocated = False
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._sources: dict[str, Path] = {}
        self._names: dict[str, str] = {}  # key -> name (for logs and stats)
        self._pinned: set[str] = set()
        self._slot_key: list[str | None] = [None] * config.max_loras
        self.stats = LoRAStats()

    # ---- registry --------------------------------------------------------------------------

    def add_adapter(self, source: str | Path, name: str, pinned: bool = False) -> LoRAAdapter:
        """Load and validate an adapter (``AdapterError`` if it is bad) and keep it in host memory."""
        adapter = load_adapter(
            source, self.base_info, max_rank=self.config.max_lora_rank, name=name
        )
        key = adapter.content_hash
        self.stats.disk_loads += 1
        self._sources[key] = Path(source)
        self._names[key] = name
        if pinned:
            self._pinned.add(key)
        self._put_host(key, adapter)
        return adapter

    def remove_adapter(self, key: str) -> None:
        self._host.pop(key, None)
        self._sources.pop(key, None)
        self._names.pop(key, None)
        self._pinned.discard(key)
        for slot, held in enumerate(self._slot_key):
            if held == key:
                self._slot_key[slot] = None

    def has_adapter(self, key: str) -> bool:
        return key in self._sources

    def pin(self, key: str, pinned: bool = True) -> None:
        if pinned:
            self._pinned.add(key)
        else:
            self._pinned.discard(key)

    def _put_host(self, key: str, adapter: LoRAAdapter) -> None:
        self._host[key] = adapter
        self._host.move_to_end(key)
        while len(self._host) > self.config.max_cpu_loras:
            victim = next((k for k in self._host if k not in self._pinned), None)
            if victim is None:
                break  # everything pinned: exceed the limit rather than drop a pinned adapter
            del self._host[victim]
            self.stats.host_evictions += 1

    def _get_host(self, key: str) -> LoRAAdapter:
        adapter = self._host.get(key)
        if adapter is not None:
            self._host.move_to_end(key)
            self.stats.host_hits += 1
            return adapter
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
        self.stats.disk_loads += 1
        self._put_host(key, adapter)
        return adapter

    # ---- residency -------------------------------------------------------------------------

    def tier_of(self, key: str) -> Literal["device", "host", "disk", "none"]:
        if key in self._slot_key:
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
        return {
            "device": sum(k is not None for k in self._slot_key),
            "host": len(self._host),
            "disk": len(self._sources),
        }

    def activate(self, lora_slots: dict[int, str]) -> None:
        """Make each slot hold its adapter for this step (copying only what changed)."""
        for slot, key in lora_slots.items():
            if self._slot_key[slot] == key:
                self.stats.slot_hits += 1
                continue
            self._load_slot(slot, self._get_host(key))
            if self._slot_key[slot] is not None:
                self.stats.slot_evictions += 1
            self._slot_key[slot] = key
            self.stats.slot_loads += 1

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        if not self._allocated:
            for _, layer in self.layers:
                layer.allocate(self.config.max_loras, self.config.max_lora_rank)
            self._allocated = True
        for i, layer in self.layers:
            per_slice: list[tuple[torch.Tensor, torch.Tensor, float] | None] = []
            for module in layer.module_names:
                ab = adapter.weights.get((i, module))
                if ab is None:
                    per_slice.append(None)
                else:
                    per_slice.append((ab[0], ab[1], adapter.scaling_of(i, module)))
            layer.set_slot(slot, per_slice)
