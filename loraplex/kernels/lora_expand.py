"""LoRA expand (Punica SGMV, second half) over the page pool:
``y[t, off_j : off_j + n_j] += buf[j, t, :r] @ lora_b[j][pages[j, s, :r]]``.

``buf`` is the shrink's output; ``lora_b[j]`` holds B^T rows (``[num_pages_j, n_j]``, PEFT
scaling folded in), so rank-row ``k`` of slot ``s`` is the contiguous row ``pages[j, s, k]`` of
the pool. Only rows of tokens with a slot are touched, and the K loop stops at each slot's own
rank in each slice, so ``buf`` columns, page entries and pool rows past it are never read.

One module: the Triton kernel, its launcher and a plain-torch reference with the same signature.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch

from loraplex.kernels.lora_shrink import (
    HAS_TRITON,
    MAX_SLICES,
    check_launch_device,
    check_weights_and_meta,
    check_workspace,
    num_tile_rows,
    pool_pointers,
    triton_interpreting,
)
from loraplex.kernels.lora_weights import LoRALayerWeights
from loraplex.kernels.meta import LoRAKernelMeta

if HAS_TRITON:
    import triton
    import triton.language as tl

    from loraplex.kernels.lora_shrink import _sum_combine


def _check_expand_args(
    buf: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta, y: torch.Tensor
) -> None:
    if y.dim() != 2 or y.dtype != weights.dtype:
        raise ValueError(
            f"y must be 2-D [T, out] {weights.dtype} like the adapter pools, got {y.dtype} "
            f"{tuple(y.shape)}"
        )
    if y.stride(1) != 1:
        raise ValueError("y must be contiguous along its last dimension")
    check_weights_and_meta(weights, meta, y.shape[0], y.device)
    spans = sorted(zip(weights.slice_offsets, weights.widths, strict=True))
    for off, n in spans:
        if off + n > y.shape[1]:
            raise ValueError(
                f"a slice at offset {off} of width {n} does not fit y's {y.shape[1]} columns"
            )
    for (off, n), (next_off, _) in itertools.pairwise(spans):
        if off + n > next_off:  # the slices' programs add into y concurrently
            raise ValueError(f"slices must not overlap in y, got offsets {weights.slice_offsets}")
    check_workspace("buf", buf, weights, y.shape[0])


# Block arithmetic, one program per (row tile, output tile) × slice:
#
#   grid = ((cdiv(T, BM) + min(T, max_loras)) * cdiv(max_j n_j, BN),  num_slices)
#
#   pid_m → (segment i, tile within it) as in lora_shrink
#
#   buf[j] rows (gathered)    B^T: pool rows pages[j, slot, k]     y[rows, off_j + cols] (scattered)
#   [BM, rank] ── K loop to the slot's rank ──▶ [rank, BN] ──▶ acc [BM, BN] fp32 ──▶ y += acc
#
# Each (token, column) of y belongs to exactly one program (slices do not overlap: checked), so
# the read-add-write needs no atomics. Programs past the last tile, of a slot with rank 0 in
# slice j, or of columns past n_j return at once.
def _lora_expand_kernel(
    buf_ptr: tl.tensor,
    b0_ptr: tl.tensor,
    b1_ptr: tl.tensor,
    b2_ptr: tl.tensor,
    y_ptr: tl.tensor,
    sorted_ptr: tl.tensor,
    active_ptr: tl.tensor,
    seg_lens_ptr: tl.tensor,
    seg_starts_ptr: tl.tensor,
    pages_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    n0: int,
    n1: int,
    n2: int,
    off0: int,
    off1: int,
    off2: int,
    MAX_N: int,
    R: int,
    max_loras: int,
    stride_bs: int,
    stride_bt: int,
    stride_yt: int,
    stride_pj: int,
    stride_ps: int,
    stride_pk: int,
    stride_rj: int,
    stride_rs: int,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LORAS_P2: tl.constexpr,
    UPCAST: tl.constexpr,
) -> None:
    # Index arithmetic in int64: offsets into a large pool (pages * width) can pass 2**31.
    pid_mn = tl.program_id(0).to(tl.int64)
    slice_id = tl.program_id(1).to(tl.int64)
    n_tiles = (MAX_N + BLOCK_N - 1) // BLOCK_N  # builtins only (see lora_shrink)
    pid_m = pid_mn // n_tiles
    pid_n = pid_mn % n_tiles
    segs = tl.arange(0, LORAS_P2)  # [P2]
    seg_tiles = (
        tl.load(seg_lens_ptr + segs, mask=segs < max_loras, other=0).to(tl.int64) + BLOCK_M - 1
    ) // BLOCK_M  # [P2]
    tiles_end = tl.associative_scan(seg_tiles, 0, _sum_combine)  # [P2] inclusive prefix sum
    if pid_m >= tl.reduce(seg_tiles, 0, _sum_combine):
        return
    seg = tl.reduce((tiles_end <= pid_m).to(tl.int64), 0, _sum_combine)
    tile = pid_m - tl.reduce(tl.where(segs == seg, tiles_end - seg_tiles, 0), 0, _sum_combine)
    slot = tl.load(active_ptr + seg).to(tl.int64)
    rank = tl.load(ranks_ptr + slice_id * stride_rj + slot * stride_rs).to(tl.int64)
    rank = tl.where(rank > R, R, rank)  # never read past the slot's row of the page index
    if rank <= 0:
        return
    b_ptr = b0_ptr
    n_out = n0
    col_off = off0
    if slice_id == 1:
        b_ptr = b1_ptr
        n_out = n1
        col_off = off1
    if slice_id == 2:
        b_ptr = b2_ptr
        n_out = n2
        col_off = off2
    if pid_n * BLOCK_N >= n_out:
        return

    seg_len = tl.load(seg_lens_ptr + seg).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row within the segment
    m_mask = offs_m < seg_len
    seg_start = tl.load(seg_starts_ptr + seg).to(tl.int64)
    tok = tl.load(sorted_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] column within slice j
    n_mask = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)  # [BK] rank index
    page_row = pages_ptr + slice_id * stride_pj + slot * stride_ps
    h_ptrs = buf_ptr + slice_id * stride_bs + tok[:, None] * stride_bt + offs_k[None, :]  # [BM, BK]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        k_mask = offs_k < rank - k0
        pages = tl.load(page_row + (k0 + offs_k) * stride_pk, mask=k_mask, other=0)  # [BK]
        b_ptrs = b_ptr + pages.to(tl.int64)[:, None] * n_out + offs_n[None, :]  # [BK, BN]
        ht = tl.load(h_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        bt = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        if UPCAST:  # the interpreter's dot mishandles bf16
            acc += tl.dot(ht.to(tl.float32), bt.to(tl.float32))
        else:
            acc += tl.dot(ht.to(bt.dtype), bt)
        h_ptrs += BLOCK_K
    y_ptrs = y_ptr + tok[:, None] * stride_yt + col_off + offs_n[None, :]  # [BM, BN]
    y_mask = m_mask[:, None] & n_mask[None, :]
    yt = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (yt.to(tl.float32) + acc).to(yt.dtype), mask=y_mask)


@functools.cache
def _jitted_expand_kernel(interpret: bool) -> Any:
    # Built on first launch, not at import: TRITON_INTERPRET is read when triton.jit runs
    # (the flag keys the cache so a later change of mode gets its own kernel).
    # The per-slice scalars are selected by branch, so they must share one type: a width or
    # offset equal to 1 must not become a constexpr.
    return triton.jit(do_not_specialize=["n0", "n1", "n2", "off0", "off1", "off2"])(
        _lora_expand_kernel
    )


def lora_expand(
    buf: torch.Tensor,
    weights: LoRALayerWeights,
    meta: LoRAKernelMeta,
    y: torch.Tensor,
    *,
    block_m: int = 32,
    block_n: int = 64,
    block_k: int = 16,
) -> None:
    """Triton expand, in place on ``y`` (see module doc).

    buf: [num_slices, T, max_rank] (fp32 or y.dtype), the shrink's output; y: [T, out] with every
    slice's columns ``[off_j, off_j + n_j)`` inside it, the slices not overlapping.
    """
    _check_expand_args(buf, weights, meta, y)
    if not meta.has_lora:
        return
    check_launch_device(y)
    S, T = weights.num_slices, y.shape[0]
    pad = MAX_SLICES - S
    b = pool_pointers(weights.lora_b)
    n = [*weights.widths, *[0] * pad]
    off = [*weights.slice_offsets, *[0] * pad]
    max_n = max(weights.widths)
    pages, ranks = weights.pages, weights.ranks
    grid = (num_tile_rows(T, meta.max_loras, block_m) * triton.cdiv(max_n, block_n), S)
    _jitted_expand_kernel(triton_interpreting())[grid](
        buf, b[0], b[1], b[2], y,
        meta.sorted_token_indices, meta.active_slots, meta.seg_lens, meta.seg_starts,
        pages, ranks,
        n[0], n[1], n[2], off[0], off[1], off[2],
        max_n, weights.max_rank, meta.max_loras, buf.stride(0), buf.stride(1), y.stride(0),
        pages.stride(0), pages.stride(1), pages.stride(2), ranks.stride(0), ranks.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        LORAS_P2=max(16, triton.next_power_of_2(meta.max_loras)),
        UPCAST=y.dtype == torch.bfloat16 and triton_interpreting(),
    )  # fmt: skip


def lora_expand_torch(
    buf: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta, y: torch.Tensor
) -> None:
    """Torch reference for ``lora_expand``: one matmul per segment and slice at the slot's rank
    in that slice, B^T gathered from the pool through the page index."""
    _check_expand_args(buf, weights, meta, y)
    if not meta.has_lora:
        return
    ranks: list[list[int]] = weights.ranks.tolist()  # [num_slices][max_loras]
    sorted_idx = meta.sorted_token_indices.to(torch.int64)  # [max_T]
    for slot, start, n in zip(
        meta.active_slot_list, meta.seg_start_list, meta.seg_len_list, strict=True
    ):
        idx = sorted_idx[start : start + n]  # [n] token rows of this segment
        for j, (pool, off) in enumerate(zip(weights.lora_b, weights.slice_offsets, strict=True)):
            r = ranks[j][slot]
            if r == 0:
                continue
            rows = weights.pages[j, slot, :r].to(torch.int64)  # [r] pool rows
            h = buf[j].index_select(0, idx)[:, :r].float()  # [n, r]
            d = h @ pool.index_select(0, rows).float()  # [n, n_j]
            cols = y[:, off : off + pool.shape[1]]  # [T, n_j] view
            out = cols.index_select(0, idx).float() + d  # [n, n_j], summed in fp32 like Triton
            cols.index_copy_(0, idx, out.to(y.dtype))
