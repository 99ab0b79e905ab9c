"""LoRA-aware linear layers: a base projection plus one delta per adapter slot and output slice.

``LoRALinear`` wraps a model's ``Linear`` / ``PackedLinear`` (qkv_proj = q|k|v, gate_up_proj =
gate|up). Adapter weights live in the manager's page pool (``LoRALayerWeights``: this layer's
pool rows per slice and the page index shared by all layers); the PEFT scaling of each (layer,
module) is folded into that slice's B rows, so one layer mixes adapters of any ranks and
scalings without padding. The step's token -> slot metadata comes from ``LoRAStep``, set by the
runner around exactly one forward pass; a step with no adapter token costs one attribute check.

Under tensor parallelism the wrapped layer is the rank's share (``engine/models/parallel.py``)
and the pool holds the rank's share of each adapter (``shard_lora``). The delta is added between
the layer's ``forward_local`` and its ``reduce``: for a row-parallel layer both the base output
and the delta (A's rows of the rank's input columns, B whole) are partial sums, and the layer's
one all-reduce sums them together.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from loraplex.kernels.lora_ops import LoRABackend, add_lora, fused_linear_lora, select_backend
from loraplex.kernels.lora_weights import LoRALayerWeights
from loraplex.kernels.meta import LoRAKernelMeta


class BaseLinear(Protocol):
    """What ``LoRALinear`` needs of the projection it wraps (the engine's ``Linear`` and
    ``PackedLinear``): its input width, its weight ``[out, in]``, its output slices by
    checkpoint module (name -> (column offset, width)), its forward split at the cross-rank
    sum (``forward_local``, ``reduce``: the identity without tensor parallelism) and its share of
    an adapter (``shard_lora``)."""

    in_features: int
    weight: torch.Tensor

    @property
    def output_slices(self) -> dict[str, tuple[int, int]]: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def forward_local(self, x: torch.Tensor) -> torch.Tensor: ...

    def reduce(self, y: torch.Tensor) -> torch.Tensor: ...

    def shard_lora(
        self, shard: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def local_gemm(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...


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
        self.weights: LoRALayerWeights | None = None  # bound when the manager allocates the pool
        self.backend: LoRABackend | None = None  # resolved once, with the stacks

    @property
    def in_features(self) -> int:
        return self.base.in_features

    def bind(self, weights: LoRALayerWeights) -> None:
        """Read adapters from ``weights`` (this layer's pool rows and the shared page index)."""
        if weights.widths != tuple(self.sizes) or weights.slice_offsets != tuple(self.offsets):
            raise ValueError(
                f"pool slices {weights.widths} at {weights.slice_offsets} do not match the "
                f"layer's {tuple(self.sizes)} at {tuple(self.offsets)}"
            )
        self.weights = weights
        self.backend = select_backend(weights.device, self.base.weight.dtype)  # activations

    def write_rows(
        self,
        j: int,
        rows: torch.Tensor,
        a: torch.Tensor | None,
        b: torch.Tensor | None,
        scaling: float,
    ) -> None:
        """Fill pool rows ``rows [R]`` of slice ``j`` with one adapter's module: A [r, in] and
        B [n_j, r] (PEFT layout) with ``r <= R``; rows past r, or all of them when the module is
        absent in this layer (``a`` None), are zeroed. Callers invalidate the slots they remap."""
        assert self.weights is not None
        pool_a, pool_b = self.weights.lora_a[j], self.weights.lora_b[j]
        r = 0 if a is None or b is None else int(a.shape[0])
        if r:
            assert a is not None and b is not None
            pool_a.index_copy_(0, rows[:r], a.to(pool_a.dtype))  # [r, in]
            pool_b.index_copy_(0, rows[:r], (b.t() * scaling).to(pool_b.dtype))  # [r, n_j]
        if r < rows.numel():
            pool_a.index_fill_(0, rows[r:], 0.0)
            pool_b.index_fill_(0, rows[r:], 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base, meta = self.base, self.step.meta
        if meta is None or not meta.has_lora or self.weights is None:
            return base.reduce(base.forward_local(x))
        # [T, out]; a partial sum on a row-parallel rank
        y = fused_linear_lora(base, x, self.weights, meta, self.backend)
        if y is None:  # not the native CPU path: the GEMM, then the delta
            y = base.forward_local(x)
            add_lora(y, x, self.weights, meta, backend=self.backend)
        return base.reduce(y)
