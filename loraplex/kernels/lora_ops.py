"""``add_lora``: the one place that picks the LoRA backend, plus the fast CPU torch path.

* ``triton`` (default on CUDA): ``lora_shrink`` into a per-step fp32 workspace, then
  ``lora_expand`` into ``y``.
* ``torch`` (default elsewhere): ``add_lora_torch`` below, which skips the per-token workspace
  and works from weights prepared once per slot (``TorchLoRACache``), not per step:

  - at most ``LOOP_MAX_SEGMENTS`` segments, each a run of rows (the runner orders requests by
    slot): per segment ``h = x[rows] @ A_s`` with every slice's A side by side and the scale
    folded in, then ``y[rows] += h @ B_s`` in place, where ``B_s`` is block-diagonal over the
    slices for decode-sized segments (one matmul for q|k|v or gate|up) and per slice otherwise.
    Each slot runs at its own rank.
  - otherwise (more segments, e.g. a decode batch over 8 adapters, or shuffled tokens): the
    step's segments in a few padded groups (``meta.torch_plan()``): one gather of the rows into
    ``[G, L, in]``, one ``bmm`` into every slice's rank columns, one ``bmm`` out, the pad rows
    dropped and the rest added to y (a slice add when they are a run of rows, else one
    ``index_add_``); a long prefill segment gets a group of its own, a slice of x and y. The
    group's stacked A/B stay cached while the group's slots and their contents are unchanged.

* ``native`` (default on the CPU in fp32 when loraplex's C kernels are built, see
  ``loraplex.kernels.native``): ``lp_lora_add`` in ``csrc/cpu_kernels.c``, one call per layer
  for all of the step's tokens, each at its own slot and rank, in tiles of up to 8 tokens of one
  slot. ``_native_pays`` sends the cases the torch path does faster (one or two row runs, ranks
  above ``NATIVE_MAX_RANK``) to the torch path.

Every path leaves base-model rows unread and unwritten.

Prepared weights are dropped by ``LoRALayerWeights.invalidate(slot)``, which every write into a
slot must call (``LoRALinear.set_slot`` does).

``LORAPLEX_LORA_BACKEND=torch|triton|native`` forces a backend; any other value is an error.
"""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from loraplex.kernels import native
from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_shrink import HAS_TRITON, check_stacks, lora_shrink
from loraplex.kernels.meta import LoRAKernelMeta, SegmentGroup

LoRABackend = Literal["torch", "triton", "native"]
BACKEND_ENV = "LORAPLEX_LORA_BACKEND"

# The per-segment loop costs 2 matmul calls per segment, the padded path 5 calls per group and
# some padded rows. Measured on 2 CPU threads with 8 decode segments (SmolLM2 shapes, rank 8) the
# padded path is 5-20% faster (the loop wins by ~25% on 1 thread); with 1-2 segments (a prefill
# chunk, one adapter) the loop wins: it multiplies in place, at each slice's exact width.
LOOP_MAX_SEGMENTS = 2
# A block-diagonal B computes every slice's columns against every slice's rank rows: (S - 1) / S
# of its multiply-adds are zeros. That is cheaper than S - 1 more matmul calls only while the
# segment is short and the rank small (decode); prefill chunks and large ranks go slice by slice.
FUSE_MAX_ROWS = 64
FUSE_MAX_RANK = 16
# The native kernel's rank limit: above it the torch path's GEMMs are faster (rank 64: 1.5x).
NATIVE_MAX_RANK = 16
# Cached groups per layer (a step has a few: the decodes, a prefill). An entry holds its slots'
# A and B at the group's rank, B block-diagonal (S times its size) when the rank is small.
GROUP_CACHE_SIZE = 2


@dataclass(frozen=True)
class LoRALayerWeights:
    """One layer's adapter stacks; slots are rows of dim 0, zero-padded beyond each rank.

    B is stored ``[max_rank, n_j]`` per slot, the layout the expand matmul reads row by row (a
    slot's first ``r`` rows are one contiguous ``[r, n_j]`` matrix).
    """

    lora_a: tuple[torch.Tensor, ...]  # per slice [max_loras, max_rank, in_features]
    lora_b: tuple[torch.Tensor, ...]  # per slice [max_loras, max_rank, n_j]
    slice_offsets: tuple[int, ...]  # column offset of slice j in the layer's output
    ranks: torch.Tensor  # [max_loras] int32, each slot's own rank (0 = empty slot)
    scales: torch.Tensor  # [max_loras] float32, PEFT alpha/r (or alpha/sqrt(r))
    cache: TorchLoRACache = field(init=False, repr=False, compare=False)

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
            if a.shape != a0.shape or b.shape[1] != max_rank:
                raise ValueError(
                    f"slice {j}: lora_a {tuple(a.shape)} / lora_b {tuple(b.shape)} do not match "
                    f"[{max_loras}, {max_rank}, in] / [{max_loras}, {max_rank}, n]"
                )
        if self.ranks.dtype != torch.int32 or tuple(self.ranks.shape) != (max_loras,):
            raise ValueError(f"ranks must be int32 [{max_loras}], got {self.ranks.dtype}")
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (max_loras,):
            raise ValueError(f"scales must be float32 [{max_loras}], got {self.scales.dtype}")
        object.__setattr__(self, "cache", TorchLoRACache(self))

    @property
    def max_rank(self) -> int:
        return int(self.lora_a[0].shape[1])

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(int(b.shape[2]) for b in self.lora_b)

    def tiles_columns(self, total_out: int) -> bool:
        """True when the slices cover columns ``[0, total_out)`` in order, without gaps."""
        end = 0
        for off, n in zip(self.slice_offsets, self.widths, strict=True):
            if off != end:
                return False
            end += n
        return end == total_out

    def invalidate(self, slot: int | None = None) -> None:
        """Forget what the torch path prepared from ``slot`` (every slot when None).

        Call after writing a slot's stacks, rank or scale; ``LoRALinear.set_slot`` does.
        """
        self.cache.invalidate(slot)


@dataclass
class SlotForm:
    """One slot's weights as the per-segment torch path multiplies them, at the slot's rank."""

    rank: int
    a: torch.Tensor  # [in, S * r] every slice's A^T side by side, scale folded in
    b: tuple[torch.Tensor, ...]  # per slice [r, n_j], views of the stacks
    b_fused: torch.Tensor | None  # [S * r, sum n_j] block-diagonal; None: one slice or r large


@dataclass
class GroupForm:
    """A padded group's stacked weights at the group's rank r (its slots' largest)."""

    rank: int
    a: torch.Tensor  # [G, in, S * r], scale folded in
    b: torch.Tensor | None  # [G, S * r, sum n_j] block-diagonal, or None: use b_slices
    b_slices: tuple[torch.Tensor, ...]  # per slice [G, r, n_j]


class TorchLoRACache:
    """What the torch path prepares from a layer's stacks, kept until a slot is rewritten.

    * host copies of the ranks and scales (no device read per call);
    * per slot: ``SlotForm`` (used by the per-segment path);
    * per group of slots: ``GroupForm`` (the padded path), least recently used dropped.
    """

    def __init__(self, weights: LoRALayerWeights) -> None:
        self._w = weights
        a0 = weights.lora_a[0]  # what every call checks, read once
        self.dtype, self.device = a0.dtype, a0.device
        self.max_loras, self.in_features = int(a0.shape[0]), int(a0.shape[2])
        ends = [off + n for off, n in zip(weights.slice_offsets, weights.widths, strict=True)]
        if min(weights.slice_offsets) < 0:
            raise ValueError(f"slice offsets must not be negative, got {weights.slice_offsets}")
        self.out_end = max(ends)  # y needs at least this many columns
        self.slice_offsets, self.widths = weights.slice_offsets, weights.widths
        # y's width when the slices tile all its columns in order (qkv, gate_up, one slice)
        self.tiled_width = self.out_end if weights.tiles_columns(self.out_end) else -1
        self.version = 0  # bumped by every invalidate (tests and debugging)
        self._ranks: list[int] | None = None
        self._scales: list[float] | None = None
        self._slots: dict[int, SlotForm | None] = {}
        self._groups: OrderedDict[tuple[int, ...], GroupForm | None] = OrderedDict()
        self._native: NativeLoRAArgs | None = None

    def native_args(self) -> NativeLoRAArgs:
        """Pointers for the native kernel (stable: the stacks are never reallocated)."""
        if self._native is None:
            self._native = NativeLoRAArgs.of(self._w)
        return self._native

    def invalidate(self, slot: int | None = None) -> None:
        self.version += 1
        self._ranks = self._scales = None
        if slot is None:
            self._slots.clear()
            self._groups.clear()
            return
        self._slots.pop(slot, None)
        for key in [k for k in self._groups if slot in k]:
            del self._groups[key]

    @property
    def ranks(self) -> list[int]:
        if self._ranks is None:
            self._ranks = self._w.ranks.tolist()
        return self._ranks

    @property
    def scales(self) -> list[float]:
        if self._scales is None:
            self._scales = self._w.scales.tolist()
        return self._scales

    def slot_form(self, slot: int) -> SlotForm | None:
        """The slot's prepared weights; None for an empty (rank 0) slot."""
        if slot in self._slots:
            return self._slots[slot]
        w, r = self._w, self.ranks[slot]
        form = None
        if r > 0:
            a = torch.cat([a[slot, :r].t() for a in w.lora_a], dim=1)  # [in, S * r]
            scale = self.scales[slot]
            if scale != 1.0:
                a.mul_(scale)
            b = tuple(b[slot, :r] for b in w.lora_b)  # [r, n_j] views
            fused = None
            if len(b) > 1 and r <= FUSE_MAX_RANK:
                fused = _block_diagonal([t.unsqueeze(0) for t in b]).squeeze(0)
            form = SlotForm(r, a, b, fused)
        self._slots[slot] = form
        return form

    def tiles(self, y: torch.Tensor) -> bool:
        """Whether the slices cover all of y's columns, in order, so one product adds them."""
        return y.shape[1] == self.tiled_width and y.is_contiguous()

    def group_form(self, slots: tuple[int, ...]) -> GroupForm | None:
        """The group's stacked weights at its largest rank; None when every rank is 0."""
        if slots in self._groups:
            self._groups.move_to_end(slots)
            return self._groups[slots]
        r = max(self.ranks[s] for s in slots)
        form = self._group_form(slots, r) if r > 0 else None
        self._groups[slots] = form
        while len(self._groups) > GROUP_CACHE_SIZE:
            self._groups.popitem(last=False)
        return form

    def _group_form(self, slots: tuple[int, ...], r: int) -> GroupForm:
        w = self._w
        idx = torch.tensor(slots, dtype=torch.int64, device=w.ranks.device)  # [G]
        a = torch.cat(
            [a[:, :r].index_select(0, idx).transpose(1, 2) for a in w.lora_a], dim=2
        )  # [G, in, S * r]
        scale = torch.tensor([self.scales[s] for s in slots], device=a.device)  # [G]
        if bool((scale != 1.0).any()):
            a.mul_(scale.to(a.dtype).view(-1, 1, 1))
        b_slices = tuple(b[:, :r].index_select(0, idx) for b in w.lora_b)  # [G, r, n_j] each
        fused = (
            _block_diagonal(list(b_slices)) if len(b_slices) > 1 and r <= FUSE_MAX_RANK else None
        )
        return GroupForm(r, a, b_slices[0] if len(b_slices) == 1 else fused, b_slices)


def _block_diagonal(blocks: list[torch.Tensor]) -> torch.Tensor:
    """``[G, r, n_j]`` per slice -> ``[G, S * r, sum n_j]`` with slice j's block at (j*r, c_j)."""
    G, r = blocks[0].shape[0], blocks[0].shape[1]
    n_total = sum(b.shape[2] for b in blocks)
    out = blocks[0].new_zeros(G, len(blocks) * r, n_total)  # [G, S * r, sum n_j]
    col = 0
    for j, b in enumerate(blocks):
        out[:, j * r : (j + 1) * r, col : col + b.shape[2]] = b
        col += b.shape[2]
    return out


def select_backend(device: torch.device, dtype: torch.dtype = torch.float32) -> LoRABackend:
    """``LORAPLEX_LORA_BACKEND`` if set; else Triton on CUDA, the native CPU kernel for fp32 on the
    CPU when it is built, and torch otherwise."""
    forced = os.environ.get(BACKEND_ENV, "").strip()
    allowed = get_args(LoRABackend)
    if forced and forced not in allowed:
        raise ValueError(f"{BACKEND_ENV}={forced!r} is not one of {', '.join(allowed)}")
    backend: LoRABackend
    if forced:
        backend = forced  # type: ignore[assignment]
    elif device.type == "cuda":
        backend = "triton"
    elif device.type == "cpu" and dtype == torch.float32 and native.library() is not None:
        backend = "native"
    else:
        backend = "torch"
    if backend == "triton" and not HAS_TRITON:
        raise RuntimeError(
            f"the Triton LoRA backend needs the `triton` package; install it or set "
            f"{BACKEND_ENV}=torch"
        )
    if backend == "native" and native.library() is None:
        raise RuntimeError(
            f"{BACKEND_ENV}=native but loraplex's native CPU kernels are not available (see the "
            f"warning above; they need a C compiler); set {BACKEND_ENV}=torch"
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
    """``y[t, off_j : off_j + n_j] += scale[s] * (x[t] @ A_j[s].T) @ B_j[s]`` for slotted tokens.

    x: [T, in_features]; y: [T, total_out], updated in place. Free when no token uses LoRA.
    """
    if not meta.has_lora:
        return
    chosen = backend or select_backend(x.device, x.dtype)
    if chosen == "triton":
        buf = meta.workspace(len(weights.lora_a), weights.max_rank)  # [num_slices, T, R] fp32
        lora_shrink(x, weights.lora_a, meta, weights.ranks, weights.scales, buf)
        lora_expand(buf, weights.lora_b, meta, weights.ranks, y, weights.slice_offsets)
    elif chosen == "native" and _native_fits(y, x, weights) and _native_pays(weights, meta):
        add_lora_native(y, x, weights, meta)
    else:
        add_lora_torch(y, x, weights, meta)


def _native_fits(y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights) -> bool:
    """The native kernel's layout: fp32 on the CPU, contiguous rows, contiguous stacks."""
    return (
        x.dtype == y.dtype == weights.cache.dtype == torch.float32
        and x.device.type == y.device.type == "cpu"
        and x.dim() == y.dim() == 2
        and x.stride(1) == 1
        and y.stride(1) == 1
    )


def _native_pays(weights: LoRALayerWeights, meta: LoRAKernelMeta) -> bool:
    """Whether the native kernel beats the torch path on this step (measured, 2 CPU threads).

    Where the torch path multiplies each segment in place (at most ``LOOP_MAX_SEGMENTS`` runs of
    rows: a prefill chunk, one adapter's decodes) it is a plain GEMM per segment and wins; so it
    does at ranks above ``NATIVE_MAX_RANK``, where the work is large enough for MKL. The native
    kernel wins where the torch path has to pad, gather and batch: many small segments.
    """
    runs = meta.row_runs
    if runs is not None and len(runs) <= LOOP_MAX_SEGMENTS:
        return False
    ranks = weights.cache.ranks
    return max(ranks[s] for s in meta.active_slot_list) <= NATIVE_MAX_RANK


@dataclass(frozen=True)
class NativeLoRAArgs:
    """A layer's stack pointers for ``lp_lora_add``, built once: the stacks never move (slot loads
    copy into them), and ranks and scales are read through their pointers at every call."""

    a_ptrs: ctypes.Array[ctypes.c_void_p]
    b_ptrs: ctypes.Array[ctypes.c_void_p]
    widths: ctypes.Array[ctypes.c_int64]
    offsets: ctypes.Array[ctypes.c_int64]

    @classmethod
    def of(cls, weights: LoRALayerWeights) -> NativeLoRAArgs:
        for t in (*weights.lora_a, *weights.lora_b, weights.ranks, weights.scales):
            if not t.is_contiguous():
                raise ValueError("the native LoRA kernel needs contiguous stacks, ranks and scales")
        n = len(weights.lora_a)
        return cls(
            a_ptrs=(ctypes.c_void_p * n)(*(a.data_ptr() for a in weights.lora_a)),
            b_ptrs=(ctypes.c_void_p * n)(*(b.data_ptr() for b in weights.lora_b)),
            widths=(ctypes.c_int64 * n)(*weights.widths),
            offsets=(ctypes.c_int64 * n)(*weights.slice_offsets),
        )


def add_lora_native(
    y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta
) -> None:
    """The native CPU backend of ``add_lora``: one ``lp_lora_add`` call over the step's tokens,
    each at its own slot and rank (``csrc/cpu_kernels.c``)."""
    _check_torch_args(y, x, weights, meta)
    if not meta.has_lora:
        return
    lib = native.library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available")
    if meta.token_slots.dtype != torch.int32 or meta.token_slots.device.type != "cpu":
        raise ValueError("meta.token_slots must be int32 on the CPU for the native backend")
    args = weights.cache.native_args()
    a0 = weights.lora_a[0]
    rc = lib.lp_lora_add(
        native.ptr(y), y.stride(0), native.ptr(x), x.stride(0), meta.num_tokens,
        x.shape[1], native.ptr(meta.token_slots), a0.shape[0], a0.shape[1],
        native.ptr(weights.ranks), native.ptr(weights.scales), len(weights.lora_a),
        args.a_ptrs, args.b_ptrs, args.widths, args.offsets, native.num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(
            f"lp_lora_add rejected its arguments (max_loras {a0.shape[0]}, max_rank {a0.shape[1]})"
        )


def _check_torch_args(
    y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta
) -> None:
    # The stacks were validated once by LoRALayerWeights; here only what varies per call.
    w = weights.cache
    if x.dim() != 2 or y.dim() != 2 or x.dtype != w.dtype or y.dtype != w.dtype:
        raise ValueError(
            f"x [T, in] and y [T, out] must be 2-D {w.dtype} like the adapter stacks, got "
            f"x {x.dtype} {tuple(x.shape)}, y {y.dtype} {tuple(y.shape)}"
        )
    if x.shape[0] != meta.num_tokens or y.shape[0] != meta.num_tokens:
        raise ValueError(
            f"x has {x.shape[0]} rows, y {y.shape[0]}, meta was prepared for {meta.num_tokens}"
        )
    if w.max_loras != meta.max_loras or w.device != x.device:
        raise ValueError(
            f"stacks hold {w.max_loras} slots on {w.device}; meta has max_loras="
            f"{meta.max_loras}, x is on {x.device}"
        )
    if w.in_features != x.shape[1]:
        raise ValueError(f"lora_a has in_features {w.in_features}, x has {x.shape[1]}")
    if w.out_end > y.shape[1]:
        raise ValueError(f"the slices need {w.out_end} columns, y has {y.shape[1]}")


def add_lora_torch(
    y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta
) -> None:
    """The torch backend of ``add_lora`` (see the module doc for its two paths)."""
    _check_torch_args(y, x, weights, meta)
    if not meta.has_lora:
        return
    # Slices that tile y's columns in order (qkv, gate_up, any single slice) take one fused
    # product per segment or group; others are added slice by slice.
    cache = weights.cache
    tiled = cache.tiles(y)
    runs = meta.row_runs
    if runs is not None and len(runs) <= LOOP_MAX_SEGMENTS:
        _add_row_runs(y, x, weights.slice_offsets, runs, cache, tiled)
        return
    for group in meta.torch_plan().groups:
        form = cache.group_form(group.slots)
        if form is not None:
            _add_group(y, x, cache, form, group, tiled)


def _add_row_runs(
    y: torch.Tensor,
    x: torch.Tensor,
    offsets: tuple[int, ...],
    runs: list[tuple[int, int, int]],
    cache: TorchLoRACache,
    tiled: bool,
) -> None:
    """Every segment is rows ``[start, end)``: two matmuls per segment, in place on y."""
    single = len(offsets) == 1
    for slot, start, end in runs:
        form = cache.slot_form(slot)
        if form is None:  # rank 0: nothing to add
            continue
        h = torch.mm(x[start:end], form.a)  # [n, S * r], scaled
        ys = y[start:end]  # [n, out] view
        if single:
            b = form.b[0]
            (ys if tiled else ys[:, offsets[0] : offsets[0] + b.shape[1]]).addmm_(h, b)
        elif tiled and form.b_fused is not None and end - start <= FUSE_MAX_ROWS:
            ys.addmm_(h, form.b_fused)  # [n, S*r] @ [S*r, out]: every slice at once
        else:
            r = form.rank
            for j, (b, off) in enumerate(zip(form.b, offsets, strict=True)):
                ys[:, off : off + b.shape[1]].addmm_(h[:, j * r : (j + 1) * r], b)


def _add_group(
    y: torch.Tensor,
    x: torch.Tensor,
    cache: TorchLoRACache,
    form: GroupForm,
    group: SegmentGroup,
    tiled: bool,
) -> None:
    G, L, K, r = len(group.slots), group.seg_len, x.shape[1], form.rank
    rows = G * L
    rs = group.row_start
    if rs is None:
        xg = x.index_select(0, group.pad_index).view(G, L, K)  # [G, L, in]
    else:
        xg = x[rs : rs + rows].reshape(G, L, K)  # [G, L, in]
    h = torch.bmm(xg, form.a)  # [G, L, S * r], scaled
    if form.b is not None:
        d = torch.bmm(h, form.b)  # [G, L, sum n_j]
    else:
        d = torch.cat(
            [torch.bmm(h[:, :, j * r : (j + 1) * r], b) for j, b in enumerate(form.b_slices)],
            dim=2,
        )  # [G, L, sum n_j]
    if tiled and rs is not None:
        y[rs : rs + rows].view(G, L, y.shape[1]).add_(d)  # no pads, no gather: a slice
        return
    # Drop the pad rows, then add the real rows where they belong.
    real = d.view(rows, d.shape[2])  # [G * L, sum n_j]
    if group.real_pos is not None:
        real = real.index_select(0, group.real_pos)  # [n, sum n_j]
    start, n = group.real_row_start, group.real_rows.shape[0]
    if tiled:
        if start is not None:
            y[start : start + n].add_(real)
        else:
            y.index_add_(0, group.real_rows, real)
        return
    col = 0
    for off, width in zip(cache.slice_offsets, cache.widths, strict=True):
        part = real[:, col : col + width]  # [n, n_j]
        col += width
        if start is not None:
            y[start : start + n, off : off + width].add_(part)
        else:  # on a column slice index_add_ falls back to scatter_add: fine off the hot path
            y[:, off : off + width].index_add_(0, group.real_rows, part)
