"""``add_lora``: the one place that picks the LoRA backend, plus the fast CPU torch path.

* ``triton`` (default on CUDA): ``lora_shrink`` into a per-step fp32 workspace, then
  ``lora_expand`` into ``y``.
* ``torch`` (default elsewhere): ``add_lora_torch`` below, which skips the per-token workspace.
  The step's segments come in a few padded groups (usually one; a long prefill segment beside
  short decode ones gets its own, so padding never wastes more than ~2×). Per group and call:
  one gather of the rows into ``[G, L, in]``, two ``bmm`` per slice against the group's slots'
  weights cut to its largest rank, and one ``index_add_`` back into ``y`` (neither gather nor
  scatter when the group's rows are already a slice of the batch, e.g. a prefill chunk).

``LORAPLEX_LORA_BACKEND=torch|triton`` forces a backend; any other value is an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_shrink import HAS_TRITON, check_stacks, lora_shrink
from loraplex.kernels.meta import LoRAKernelMeta, SegmentGroup

LoRABackend = Literal["torch", "triton"]
BACKEND_ENV = "LORAPLEX_LORA_BACKEND"


@dataclass(frozen=True)
class LoRALayerWeights:
    """One layer's adapter stacks; slots are rows of dim 0, zero-padded beyond each rank."""

    lora_a: tuple[torch.Tensor, ...]  # per slice [max_loras, max_rank, in_features]
    lora_b: tuple[torch.Tensor, ...]  # per slice [max_loras, n_j, max_rank]
    slice_offsets: tuple[int, ...]  # column offset of slice j in the layer's output
    ranks: torch.Tensor  # [max_loras] int32, each slot's own rank (0 = empty slot)
    scales: torch.Tensor  # [max_loras] float32, PEFT alpha/r (or alpha/sqrt(r))

    def __post_init__(self) -> None:
        if not (len(self.lora_a) == len(self.lora_b) == len(self.slice_offsets) >= 1):
            raise ValueError(
                f"lora_a, lora_b and slice_offsets need one entry per slice, got "
                f"{len(self.lora_a)}, {len(self.lora_b)}, {len(self.slice_offsets)}"
            )
        a0 = self.lora_a[0]
        if a0.dim() != 3:
            raise ValueError(f"lora_a[0] must be [max_loras, max_rank, in], got {tuple(a0.shape)}")
        max_loras, max_rank, _ = a0.shape
        check_stacks("lora_a", self.lora_a, a0.dtype, max_loras)
        check_stacks("lora_b", self.lora_b, a0.dtype, max_loras)
        for j, (a, b) in enumerate(zip(self.lora_a, self.lora_b, strict=True)):
            if a.shape != a0.shape or b.shape[2] != max_rank:
                raise ValueError(
                    f"slice {j}: lora_a {tuple(a.shape)} / lora_b {tuple(b.shape)} do not match "
                    f"[{max_loras}, {max_rank}, in] / [{max_loras}, n, {max_rank}]"
                )
        if self.ranks.dtype != torch.int32 or tuple(self.ranks.shape) != (max_loras,):
            raise ValueError(f"ranks must be int32 [{max_loras}], got {self.ranks.dtype}")
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (max_loras,):
            raise ValueError(f"scales must be float32 [{max_loras}], got {self.scales.dtype}")

    @property
    def max_rank(self) -> int:
        return int(self.lora_a[0].shape[1])

    def tiles_columns(self, total_out: int) -> bool:
        """True when the slices cover columns ``[0, total_out)`` in order, without gaps."""
        end = 0
        for off, b in zip(self.slice_offsets, self.lora_b, strict=True):
            if off != end:
                return False
            end += b.shape[1]
        return end == total_out


def select_backend(device: torch.device) -> LoRABackend:
    """``LORAPLEX_LORA_BACKEND`` if set, else Triton on CUDA and torch elsewhere."""
    forced = os.environ.get(BACKEND_ENV, "").strip()
    allowed = get_args(LoRABackend)
    if forced and forced not in allowed:
        raise ValueError(f"{BACKEND_ENV}={forced!r} is not one of {', '.join(allowed)}")
    backend: LoRABackend = (
        "triton" if forced == "triton" or (not forced and device.type == "cuda") else "torch"
    )
    if backend == "triton" and not HAS_TRITON:
        raise RuntimeError(
            f"the Triton LoRA backend needs the `triton` package; install it or set "
            f"{BACKEND_ENV}=torch"
        )
    return backend


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    weights: LoRALayerWeights,
    meta: LoRAKernelMeta,
    *,
    backend: LoRABackend | None = None,
) -> None:
    """``y[t, off_j : off_j + n_j] += scale[s] * (x[t] @ A_j[s].T) @ B_j[s].T`` for slotted tokens.

    x: [T, in_features]; y: [T, total_out], updated in place. Free when no token uses LoRA.
    """
    if not meta.has_lora:
        return
    if (backend or select_backend(x.device)) == "triton":
        buf = meta.workspace(len(weights.lora_a), weights.max_rank)  # [num_slices, T, R] fp32
        lora_shrink(x, weights.lora_a, meta, weights.ranks, weights.scales, buf)
        lora_expand(buf, weights.lora_b, meta, weights.ranks, y, weights.slice_offsets)
    else:
        add_lora_torch(y, x, weights, meta)


def _check_torch_args(
    y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta
) -> None:
    # The stacks were validated once by LoRALayerWeights; here only what varies per call.
    a0 = weights.lora_a[0]
    if x.dim() != 2 or y.dim() != 2 or x.dtype != a0.dtype or y.dtype != a0.dtype:
        raise ValueError(
            f"x [T, in] and y [T, out] must be 2-D {a0.dtype} like the adapter stacks, got "
            f"x {x.dtype} {tuple(x.shape)}, y {y.dtype} {tuple(y.shape)}"
        )
    if x.shape[0] != meta.num_tokens or y.shape[0] != meta.num_tokens:
        raise ValueError(
            f"x has {x.shape[0]} rows, y {y.shape[0]}, meta was prepared for {meta.num_tokens}"
        )
    if a0.shape[0] != meta.max_loras or a0.device != x.device:
        raise ValueError(
            f"stacks hold {a0.shape[0]} slots on {a0.device}; meta has max_loras="
            f"{meta.max_loras}, x is on {x.device}"
        )
    if a0.shape[2] != x.shape[1]:
        raise ValueError(f"lora_a has in_features {a0.shape[2]}, x has {x.shape[1]}")
    for j, (off, b) in enumerate(zip(weights.slice_offsets, weights.lora_b, strict=True)):
        if off < 0 or off + b.shape[1] > y.shape[1]:
            raise ValueError(f"slice {j} does not fit y's {y.shape[1]} columns")


def add_lora_torch(
    y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta
) -> None:
    """The torch backend of ``add_lora``: one padded, batched pass per segment group."""
    _check_torch_args(y, x, weights, meta)
    if not meta.has_lora:
        return
    rank_list: list[int] = weights.ranks.tolist()
    # Slices that tile y's columns in order (qkv, gate_up, any single slice) are scattered with
    # one index_add_ of their concatenation: index_add_ on a column slice of y falls back to
    # scatter_add (~10x slower on CPU), and one call beats one per slice.
    tiled = y.is_contiguous() and weights.tiles_columns(y.shape[1])
    for group in meta.torch_plan().groups:
        r = max(rank_list[s] for s in group.slots)  # the group's largest rank, not max_rank
        if r > 0:
            _add_group(y, x, weights, group, r, tiled)


def _add_group(
    y: torch.Tensor,
    x: torch.Tensor,
    weights: LoRALayerWeights,
    group: SegmentGroup,
    r: int,
    tiled: bool,
) -> None:
    G, L, K = len(group.slots), group.seg_len, x.shape[1]
    lo = group.slots[0]
    if group.slots[-1] - lo == G - 1:  # slots lo..lo+G-1: views, no weight copies
        a_sel = [a[lo : lo + G, :r] for a in weights.lora_a]  # [G, r, in] each
        b_sel = [b[lo : lo + G, :, :r] for b in weights.lora_b]  # [G, n_j, r] each
        scale = weights.scales[lo : lo + G]  # [G]
    else:
        idx = group.slot_index
        a_sel = [a[:, :r].index_select(0, idx) for a in weights.lora_a]  # [G, r, in] copies
        b_sel = [b[:, :, :r].index_select(0, idx) for b in weights.lora_b]  # [G, n_j, r] copies
        scale = weights.scales.index_select(0, idx)
    rowscale = group.pad_mask * scale.view(G, 1, 1)  # [G, L, 1], 0 on pads
    rows = G * L
    rs = group.row_start
    if rs is None:
        xg = x.index_select(0, group.pad_index).view(G, L, K)  # [G, L, in]
    else:
        xg = x[rs : rs + rows].reshape(G, L, K)  # [G, L, in]
    deltas: list[torch.Tensor] = []
    for a, b, off in zip(a_sel, b_sel, weights.slice_offsets, strict=True):
        n = b.shape[1]
        h = torch.bmm(xg, a.transpose(1, 2)).mul_(rowscale)  # [G, L, r]
        d = torch.bmm(h, b.transpose(1, 2))  # [G, L, n]
        cols = y[:, off : off + n]  # [T, n] view
        if rs is not None:
            cols[rs : rs + rows].view(G, L, n).add_(d)
        elif tiled:
            deltas.append(d)
        else:  # pads add zeros; accumulate=True sums the duplicate pad rows correctly
            cols.index_put_((group.pad_index,), d.view(rows, n), accumulate=True)
    if deltas:
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=2)  # [G, L, out]
        y.index_add_(0, group.pad_index, delta.view(rows, y.shape[1]))  # pads add zeros
