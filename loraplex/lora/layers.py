"""LoRA-aware linear layers: a base projection plus one delta per adapter slot and output slice.

``LoRALinear`` wraps a model's ``Linear`` / ``PackedLinear`` (qkv_proj = q|k|v, gate_up_proj =
gate|up). Its stacks hold every device slot's weights, zero-padded to ``max_rank``; the PEFT
scaling of each (layer, module) is folded into that slice's B so one layer may mix adapters of
different ranks and scalings. The step's token -> slot metadata comes from ``LoRAStep``, set by the
runner around exactly one forward pass; a step with no adapter token costs one attribute check.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from loraplex.kernels.lora_ops import LoRABackend, LoRALayerWeights, add_lora, select_backend
from loraplex.kernels.meta import LoRAKernelMeta


class BaseLinear(Protocol):
    """What ``LoRALinear`` needs of the projection it wraps (the engine's ``Linear`` and
    ``PackedLinear``): its input width, its weight ``[out, in]``, its output slices by
    checkpoint module (name -> (column offset, width)), and its forward."""

    in_features: int
    weight: torch.Tensor

    @property
    def output_slices(self) -> dict[str, tuple[int, int]]: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class LoRAStep:
    """The LoRA metadata of the forward pass being run (None between steps)."""

    def __init__(self) -> None:
        self.meta: LoRAKernelMeta | None = None

    @contextmanager
    def active(self, meta: LoRAKernelMeta) -> Iterator[None]:
        if self.meta is not None:
            raise RuntimeError("LoRAStep.active() does not nest: one forward pass at a time")
        self.meta = meta
        try:
            yield
        finally:
            self.meta = None


class LoRALinear(nn.Module):
    def __init__(self, base: BaseLinear, module_names: list[str], step: LoRAStep) -> None:
        super().__init__()
        self.base = base
        slices = base.output_slices
        if len(slices) != len(module_names):
            raise ValueError(f"{len(module_names)} module names for {len(slices)} output slices")
        # slice j: checkpoint module name, output column offset, width
        self.module_names = module_names
        self.offsets = [off for off, _ in slices.values()]
        self.sizes = [size for _, size in slices.values()]
        self.step = step
        self.weights: LoRALayerWeights | None = None  # allocated at the first adapter load
        self.backend: LoRABackend | None = None  # resolved once, with the stacks

    @property
    def in_features(self) -> int:
        return self.base.in_features

    def allocate(self, max_loras: int, max_rank: int) -> None:
        w = self.base.weight
        dtype, device = w.dtype, w.device
        self.weights = LoRALayerWeights(
            lora_a=tuple(
                torch.zeros(max_loras, max_rank, self.in_features, dtype=dtype, device=device)
                for _ in self.sizes
            ),  # per slice [max_loras, max_rank, in]
            lora_b=tuple(
                torch.zeros(max_loras, max_rank, n, dtype=dtype, device=device) for n in self.sizes
            ),  # per slice [max_loras, max_rank, n_j]
            slice_offsets=tuple(self.offsets),
            ranks=torch.zeros(max_loras, dtype=torch.int32, device=w.device),
            scales=torch.ones(max_loras, dtype=torch.float32, device=w.device),
        )
        self.backend = select_backend(device, dtype)

    def set_slot(
        self, slot: int, per_slice: list[tuple[torch.Tensor, torch.Tensor, float] | None]
    ) -> None:
        """Write one adapter into ``slot``: per slice (A [r, in], B [n, r], scaling) or None.

        Drops whatever the LoRA kernels prepared from the slot's previous contents.
        """
        assert self.weights is not None
        rank = 0
        for j, entry in enumerate(per_slice):
            a_stack, b_stack = self.weights.lora_a[j][slot], self.weights.lora_b[j][slot]
            a_stack.zero_()
            b_stack.zero_()
            if entry is None:
                continue
            a, b, scaling = entry
            r = a.shape[0]
            a_stack[:r].copy_(a)  # [r, in]
            b_stack[:r].copy_((b * scaling).t())  # [r, n], PEFT scaling folded in
            rank = max(rank, r)
        self.weights.ranks[slot] = rank
        self.weights.invalidate(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [T, out]
        meta = self.step.meta
        if meta is not None and meta.has_lora and self.weights is not None:
            add_lora(y, x, self.weights, meta, backend=self.backend)
        return y
