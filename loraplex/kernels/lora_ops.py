"""``add_lora``: the one place that picks the LoRA backend, plus the fast CPU torch path.

Every backend reads the adapter pool through the page index (``lora_weights``): each token's
adapter rows, at that adapter's own rank in each slice, for any number of adapters in a step.

* ``triton`` (default on CUDA): ``lora_shrink`` into a per-step fp32 workspace, then
  ``lora_expand`` into ``y``.
* ``torch`` (default elsewhere): ``add_lora_torch`` below, which skips the per-token workspace
  and works from rows gathered once per slot (``TorchLoRACache``), not per step:

  - at most ``LOOP_MAX_SEGMENTS`` segments, each a run of rows (the runner orders requests by
    slot): per segment ``h = x[rows] @ A_s`` with every slice's A side by side, then
    ``y[rows] += h @ B_s`` in place, where ``B_s`` is block-diagonal over the slices for
    decode-sized segments (one matmul for q|k|v or gate|up) and per slice otherwise. Each slice
    runs at the slot's own rank in it.
  - otherwise (more segments, e.g. a decode batch over 8 adapters, or shuffled tokens): the
    step's segments in a few padded groups (``meta.torch_plan()``): one gather of the rows into
    ``[G, L, in]``, one ``bmm`` into every slice's rank columns, one ``bmm`` out, the pad rows
    dropped and the rest added to y (a slice add when they are a run of rows, else one
    ``index_add_``); a long prefill segment gets a group of its own, a slice of x and y. The
    group's stacked A/B (zero-padded to the group's largest rank, a compute-time copy, never
    pool memory) stay cached while the group's slots and their contents are unchanged.

* ``native`` (default on the CPU in fp32 when loraplex's C kernels are built, see
  ``loraplex.kernels.native``): ``lp_lora_add`` in ``csrc/cpu_kernels.c``, one call per layer
  for all of the step's tokens, each at its own slot and rank, in tiles of up to 8 tokens of one
  slot. ``_native_pays`` sends the cases the torch path does faster (ranks above
  ``NATIVE_MAX_RANK`` in one or two row runs, or that padding would not waste) to the torch path.

Every path leaves base-model rows unread and unwritten.

``LORAPLEX_LORA_BACKEND=torch|triton|native`` forces a backend; any other value is an error.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch

from loraplex.kernels import native, packed_gemm
from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_native import prepare_call, try_native
from loraplex.kernels.lora_shrink import HAS_TRITON, lora_shrink
from loraplex.kernels.lora_weights import LoRALayerWeights
from loraplex.kernels.meta import LoRAKernelMeta, SegmentGroup

LoRABackend = Literal["torch", "triton", "native"]
BACKEND_ENV = "LORAPLEX_LORA_BACKEND"

# The per-segment loop costs 2 matmul calls per segment, the padded path 5 calls per group and
# some padded rows. With 8 decode segments (SmolLM2 shapes, rank 8, 2 threads) the padded path
# is faster (on 1 thread the loop); with 1-2 segments (a prefill chunk, one adapter) the loop
# wins: it multiplies in place, at each slice's exact width. Measured with
# ``LORAPLEX_LORA_BACKEND=torch loraplex bench throughput --num-adapters 8 --skip-hf``.
LOOP_MAX_SEGMENTS = 2
# A block-diagonal B computes every slice's columns against every slice's rank rows: (S - 1) / S
# of its multiply-adds are zeros. That is cheaper than S - 1 more matmul calls only while the
# segment is short and the rank small (decode); prefill chunks and large ranks go slice by slice.
FUSE_MAX_ROWS = 64
FUSE_MAX_RANK = 16
# The native kernel's rank limit: above it the torch path's GEMMs are faster (``loraplex bench
# throughput --num-adapters 8 --adapter-rank 64 --skip-hf``, LORAPLEX_LORA_BACKEND=torch/native)...
NATIVE_MAX_RANK = 16
# ... unless padding every slot of a step to its largest rank wastes more than that: the torch
# path's padded rank-rows over the native kernel's own-rank rows, above which native runs anyway.
PAD_WASTE = 1.5
# Cached groups per layer (a step has a few: the decodes, a prefill). An entry holds its slots'
# A and B at the group's rank, B block-diagonal (S times its size) when the rank is small.
GROUP_CACHE_SIZE = 2
# Cached per-slot forms per layer: the per-segment path runs at most LOOP_MAX_SEGMENTS slots a
# step; a few more keep alternating adapters warm. Each is a gathered copy of the slot's rows.
SLOT_CACHE_SIZE = 8


# Activation dtypes a pool dtype may serve: a half-precision pool under fp32 activations
# (``lora_dtype``) is upcast as it is read; otherwise pool and activations agree.
_ACT_DTYPES: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float16: (torch.float16, torch.float32),
    torch.bfloat16: (torch.bfloat16, torch.float32),
}


@dataclass
class SlotForm:
    """One slot's rows as the per-segment torch path multiplies them, at its ranks."""

    ranks: tuple[int, ...]  # per slice (0: the adapter does not target the slice)
    cols: tuple[int, ...]  # first column of slice j's block in h
    a: torch.Tensor  # [in, sum r_j] every slice's A^T side by side
    b: tuple[torch.Tensor | None, ...]  # per slice [r_j, n_j] (None: rank 0)
    b_fused: torch.Tensor | None  # [sum r_j, sum n_j] block-diagonal; None: one slice or r large


@dataclass
class GroupForm:
    """A padded group's stacked rows at the group's rank r (the largest of its slots/slices)."""

    rank: int
    a: torch.Tensor  # [G, in, S * r], zero columns beyond each slot's rank
    b: torch.Tensor | None  # [G, S * r, sum n_j] block-diagonal, or None: use b_slices
    b_slices: tuple[torch.Tensor, ...]  # per slice [G, r, n_j]


class TorchLoRACache:
    """What the torch path gathers from a layer's pool, kept until a slot is rewritten.

    * host copies of the ranks (no device read per call);
    * per slot: ``SlotForm`` (the per-segment path), least recently used dropped;
    * per group of slots: ``GroupForm`` (the padded path), least recently used dropped.
    """

    def __init__(self, weights: LoRALayerWeights) -> None:
        self._w = weights
        self.dtype, self.device = weights.dtype, weights.device  # the pool's
        # The activations' dtype, fixed by the first call: gathered forms are kept in it (a
        # float16 or bfloat16 pool under fp32 activations is upcast once per form).
        self.act_dtype: torch.dtype | None = None
        self.max_loras, self.in_features = weights.max_loras, weights.in_features
        ends = [off + n for off, n in zip(weights.slice_offsets, weights.widths, strict=True)]
        self.out_end = max(ends)  # y needs at least this many columns
        self.slice_offsets, self.widths = weights.slice_offsets, weights.widths
        # y's width when the slices tile all its columns in order (qkv, gate_up, one slice)
        self.tiled_width = self.out_end if weights.tiles_columns(self.out_end) else -1
        self.version = 0  # bumped by every invalidate (tests and debugging)
        self._ranks: list[list[int]] | None = None  # [S][max_loras]
        self._slot_rank: list[int] | None = None  # [max_loras] largest rank over slices
        self._slots: OrderedDict[int, SlotForm | None] = OrderedDict()
        self._groups: OrderedDict[tuple[int, ...], GroupForm | None] = OrderedDict()

    @classmethod
    def of(cls, weights: LoRALayerWeights) -> TorchLoRACache:
        cache = weights.caches.get("torch")
        if not isinstance(cache, TorchLoRACache):
            cache = cls(weights)
            weights.caches["torch"] = cache
        return cache

    def invalidate(self, slot: int | None = None) -> None:
        self.version += 1
        self._ranks = self._slot_rank = None
        if slot is None:
            self._slots.clear()
            self._groups.clear()
            return
        self._slots.pop(slot, None)
        for key in [k for k in self._groups if slot in k]:
            del self._groups[key]

    @property
    def ranks(self) -> list[list[int]]:
        if self._ranks is None:
            self._ranks = self._w.ranks.tolist()
        return self._ranks

    @property
    def slot_ranks(self) -> list[int]:
        """Each slot's largest rank over the slices (0: nothing to add)."""
        if self._slot_rank is None:
            self._slot_rank = [max(col) for col in zip(*self.ranks, strict=True)]
        return self._slot_rank

    @property
    def _act(self) -> torch.dtype:
        return self.dtype if self.act_dtype is None else self.act_dtype

    def _rows(self, j: int, slot: int, r: int) -> torch.Tensor:
        return self._w.pages[j, slot, :r].to(torch.int64)  # [r] pool rows

    def slot_form(self, slot: int) -> SlotForm | None:
        """The slot's gathered rows; None when it adds nothing (rank 0 in every slice)."""
        if slot in self._slots:
            self._slots.move_to_end(slot)
            return self._slots[slot]
        w = self._w
        ranks = tuple(self.ranks[j][slot] for j in range(w.num_slices))
        form = None
        if max(ranks) > 0:
            a_parts: list[torch.Tensor] = []
            b_parts: list[torch.Tensor | None] = []
            cols: list[int] = []
            col = 0
            for j, r in enumerate(ranks):
                cols.append(col)
                col += r
                if r == 0:
                    b_parts.append(None)
                    continue
                rows = self._rows(j, slot, r)
                a_parts.append(w.lora_a[j].index_select(0, rows).to(self._act).t())  # [in, r]
                b_parts.append(w.lora_b[j].index_select(0, rows).to(self._act))  # [r, n_j]
            a = torch.cat(a_parts, dim=1)  # [in, sum r_j]
            fused = None
            if len(ranks) > 1 and max(ranks) <= FUSE_MAX_RANK:
                fused = a.new_zeros(col, sum(self.widths))  # [sum r_j, sum n_j]
                out_col = 0
                for j, (b, n) in enumerate(zip(b_parts, self.widths, strict=True)):
                    if b is not None:
                        fused[cols[j] : cols[j] + ranks[j], out_col : out_col + n] = b
                    out_col += n
            form = SlotForm(ranks, tuple(cols), a, tuple(b_parts), fused)
        self._slots[slot] = form
        while len(self._slots) > SLOT_CACHE_SIZE:
            self._slots.popitem(last=False)
        return form

    def tiles(self, y: torch.Tensor) -> bool:
        """Whether the slices cover all of y's columns, in order, so one product adds them."""
        return y.shape[1] == self.tiled_width and y.is_contiguous()

    def group_form(self, slots: tuple[int, ...]) -> GroupForm | None:
        """The group's stacked rows at its largest rank; None when every rank is 0."""
        if slots in self._groups:
            self._groups.move_to_end(slots)
            return self._groups[slots]
        r = max(self.slot_ranks[s] for s in slots)
        form = self._group_form(slots, r) if r > 0 else None
        self._groups[slots] = form
        while len(self._groups) > GROUP_CACHE_SIZE:
            self._groups.popitem(last=False)
        return form

    def _group_form(self, slots: tuple[int, ...], r: int) -> GroupForm:
        w = self._w
        dev = w.pages.device
        idx = torch.tensor(slots, dtype=torch.int64, device=dev)  # [G]
        k = torch.arange(r, device=dev)  # [r]
        a_parts, b_parts = [], []
        for j in range(w.num_slices):
            pages = w.pages[j].index_select(0, idx)[:, :r].to(torch.int64)  # [G, r]
            live = k.unsqueeze(0) < w.ranks[j].index_select(0, idx).unsqueeze(1)  # [G, r]
            rows = torch.where(live, pages, 0).view(-1)  # [G * r]; dead entries: row 0
            keep = live.to(self._act).unsqueeze(2)  # [G, r, 1]
            a_j = w.lora_a[j].index_select(0, rows).to(self._act).view(len(slots), r, -1) * keep
            b_j = w.lora_b[j].index_select(0, rows).to(self._act).view(len(slots), r, -1) * keep
            a_parts.append(a_j.transpose(1, 2))  # [G, in, r]
            b_parts.append(b_j)
        a = torch.cat(a_parts, dim=2).contiguous()  # [G, in, S * r]
        b_slices = tuple(b_parts)
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
    """``y[t, off_j : off_j + n_j] += (x[t] @ A_j.T) @ B_j^T`` with each token's adapter rows.

    x: [T, in_features]; y: [T, total_out], updated in place. Free when no token uses LoRA.
    """
    if not meta.has_lora:
        return
    chosen = backend or select_backend(x.device, x.dtype)
    if chosen == "triton" and weights.dtype == x.dtype:
        buf = meta.workspace(weights.num_slices, weights.max_rank)  # [S, T, max_rank] fp32
        lora_shrink(x, weights, meta, buf)
        lora_expand(buf, weights, meta, y)
    elif chosen != "native" or not (
        _native_pays(weights, meta) and try_native(y, x, weights, meta)
    ):
        add_lora_torch(y, x, weights, meta)


class GemmLayer(Protocol):
    """A projection whose local output is ``packed_gemm.linear(x, *local_gemm())``."""

    def local_gemm(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...


def fused_linear_lora(
    base: GemmLayer,
    x: torch.Tensor,
    weights: LoRALayerWeights,
    meta: LoRAKernelMeta,
    backend: LoRABackend | None,
) -> torch.Tensor | None:
    """``base``'s local output with the step's LoRA delta added, in one native call (the packed
    GEMM, the adapters' rows fetched while it computes, then the LoRA tiles from cache), or None
    where that does not apply: not the native backend, a step the torch path does better, a
    batch beyond the packed kernel's rows, an unpacked weight. Then the caller runs the GEMM
    and ``add_lora``."""
    if backend != "native" or not meta.has_lora or not _native_pays(weights, meta):
        return None
    weight, packed, bias = base.local_gemm()
    if packed is None:
        return None
    return packed_gemm.linear_lora(
        x, weight, packed, bias, lambda y: prepare_call(y, x, weights, meta)
    )


def _native_pays(weights: LoRALayerWeights, meta: LoRAKernelMeta) -> bool:
    """Whether the native kernel beats the torch path on this step (measured on 2 CPU threads
    with ``loraplex bench throughput --num-adapters 8 --skip-hf`` under each
    ``LORAPLEX_LORA_BACKEND``).

    At ranks up to ``NATIVE_MAX_RANK`` the native kernel wins outright, for any segments: on
    SmolLM2's shapes at rank 8 it matches the torch path's in-place GEMM on one 512-row prefill
    segment and is several times faster on decode-sized ones (1-16 rows), where the torch path's
    ~15 ops per call cost more than the arithmetic. Above it the torch GEMMs are faster at equal
    work: the per-segment loop (at most ``LOOP_MAX_SEGMENTS`` runs of rows) keeps such steps, and
    with more segments, where the torch path pads every slot of a group to the group's largest
    rank, the native kernel takes the step only when padding would cost more than that
    (``PAD_WASTE``: mixed ranks).
    """
    # Ranks are per module, the same in every layer (their index rows are one table): work the
    # answer out once per step for all layers that share it. The index does not change within a
    # step (the manager writes it before meta.prepare).
    key = ("native_pays", weights.ranks.data_ptr())
    pays = meta.step_memo.get(key)
    if pays is None:
        ranks = TorchLoRACache.of(weights).slot_ranks
        active = [ranks[s] for s in meta.active_slot_list]
        top = max(active)
        runs = meta.row_runs
        few_runs = runs is not None and len(runs) <= LOOP_MAX_SEGMENTS
        pays = top <= NATIVE_MAX_RANK or (
            not few_runs and top * len(active) > PAD_WASTE * sum(active)
        )
        meta.step_memo[key] = pays
    return bool(pays)


def _check_torch_args(
    y: torch.Tensor, x: torch.Tensor, w: TorchLoRACache, meta: LoRAKernelMeta
) -> None:
    # The pools were validated once by LoRALayerWeights; here only what varies per call.
    if w.act_dtype is None and x.dtype in _ACT_DTYPES.get(w.dtype, (w.dtype,)):
        w.act_dtype = x.dtype
    if x.dim() != 2 or y.dim() != 2 or x.dtype != w.act_dtype or y.dtype != w.act_dtype:
        raise ValueError(
            f"x [T, in] and y [T, out] must be 2-D {w.act_dtype or w.dtype} (the adapter pool "
            f"is {w.dtype}), got x {x.dtype} {tuple(x.shape)}, y {y.dtype} {tuple(y.shape)}"
        )
    if x.shape[0] != meta.num_tokens or y.shape[0] != meta.num_tokens:
        raise ValueError(
            f"x has {x.shape[0]} rows, y {y.shape[0]}, meta was prepared for {meta.num_tokens}"
        )
    if w.max_loras != meta.max_loras or w.device != x.device:
        raise ValueError(
            f"the page index holds {w.max_loras} slots on {w.device}; meta has max_loras="
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
    cache = TorchLoRACache.of(weights)
    _check_torch_args(y, x, cache, meta)
    if not meta.has_lora:
        return
    # Slices that tile y's columns in order (qkv, gate_up, any single slice) take one fused
    # product per segment or group; others are added slice by slice.
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
    for slot, start, end in runs:
        form = cache.slot_form(slot)
        if form is None:  # rank 0 everywhere: nothing to add
            continue
        h = torch.mm(x[start:end], form.a)  # [n, sum r_j]
        ys = y[start:end]  # [n, out] view
        if tiled and form.b_fused is not None and end - start <= FUSE_MAX_ROWS:
            ys.addmm_(h, form.b_fused)  # [n, sum r_j] @ [sum r_j, out]: every slice at once
            continue
        for j, (b, off) in enumerate(zip(form.b, offsets, strict=True)):
            if b is None:
                continue
            c, r = form.cols[j], form.ranks[j]
            ys[:, off : off + b.shape[1]].addmm_(h[:, c : c + r], b)


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
    h = torch.bmm(xg, form.a)  # [G, L, S * r]
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
