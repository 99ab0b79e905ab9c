"""LoRA expand (Punica SGMV, second half): ``y[t, off_j : off_j + n_j] += buf[j, t, :r] @ B_j[s, :r]``.

One module: the Triton kernel, its launcher and a plain-torch reference with the same signature.
``buf`` is the shrink's output (scale already folded in). B is stored ``[max_loras, R, n_j]``
(rank-major: a tile of B is ``BLOCK_N`` consecutive values per rank row). Only rows of tokens
with a slot are touched, and the K loop stops at each slot's own rank, so ``buf`` columns (and B
rows) past it are never read.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from loraplex.kernels.lora_shrink import (
    HAS_TRITON,
    MAX_SLICES,
    SUPPORTED_DTYPES,
    check_launch_device,
    check_meta_args,
    check_stacks,
    triton_interpreting,
)
from loraplex.kernels.meta import LoRAKernelMeta

if HAS_TRITON:
    import triton
    import triton.language as tl


def _check_expand_args(
    buf: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    meta: LoRAKernelMeta,
    ranks: torch.Tensor,
    y: torch.Tensor,
    slice_offsets: Sequence[int],
) -> None:
    if y.dim() != 2 or y.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"y must be 2-D [T, out] fp32/fp16/bf16, got {y.dtype} {tuple(y.shape)}")
    if y.stride(1) != 1:
        raise ValueError("y must be contiguous along its last dimension")
    check_meta_args(meta, y.shape[0], ranks, y.device)
    check_stacks("lora_b", lora_b, y.dtype, meta.max_loras)
    if len(slice_offsets) != len(lora_b):
        raise ValueError(f"{len(lora_b)} lora_b slices but {len(slice_offsets)} slice_offsets")
    R = lora_b[0].shape[1]
    for j, (b, off) in enumerate(zip(lora_b, slice_offsets, strict=True)):
        if b.shape[1] != R:
            raise ValueError(f"lora_b[{j}] has rank dim {b.shape[1]}, lora_b[0] has {R}")
        if off < 0 or off + b.shape[2] > y.shape[1]:
            raise ValueError(
                f"slice {j} (offset {off}, width {b.shape[2]}) does not fit y's {y.shape[1]} "
                "columns"
            )
    want = (len(lora_b), y.shape[0], R)
    if tuple(buf.shape) != want or buf.dtype not in (torch.float32, y.dtype):
        raise ValueError(
            f"buf must be {list(want)} float32 or {y.dtype}, got {buf.dtype} {tuple(buf.shape)}"
        )
    if buf.stride(2) != 1:
        raise ValueError("buf must be contiguous along its last dimension")


# Block arithmetic, one program per (token tile, output tile) × slice × segment:
#
#   grid = (cdiv(max_num_tokens, BM) * cdiv(max_j n_j, BN),  num_slices,  max_loras)
#
#   buf[j] rows (gathered)      B_j[slot]                 y[rows, off_j + cols] (scattered)
#   [BM, rank] ── K loop to the slot's rank ──▶ [rank, BN] ──▶ acc [BM, BN] fp32 ──▶ y += acc
#
# Each (token, column) of y belongs to exactly one program, so the read-add-write needs no atomics.
# Programs of unused segments, rows past the segment, or columns past n_j return at once.
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
    ranks_ptr: tl.tensor,
    n0: int,
    n1: int,
    n2: int,
    off0: int,
    off1: int,
    off2: int,
    MAX_N: int,
    R: int,
    stride_bs: int,
    stride_bt: int,
    stride_yt: int,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
) -> None:
    pid_mn = tl.program_id(0)
    slice_id = tl.program_id(1)
    seg = tl.program_id(2)
    slot = tl.load(active_ptr + seg)
    if slot < 0:
        return
    seg_len = tl.load(seg_lens_ptr + seg)
    rank = tl.load(ranks_ptr + slot)
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
    n_tiles = (MAX_N + BLOCK_N - 1) // BLOCK_N  # builtins only (see lora_shrink)
    pid_m = pid_mn // n_tiles
    pid_n = pid_mn % n_tiles
    if pid_m * BLOCK_M >= seg_len:
        return
    if pid_n * BLOCK_N >= n_out:
        return
    if rank == 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row within the segment
    m_mask = offs_m < seg_len
    seg_start = tl.load(seg_starts_ptr + seg)
    tok = tl.load(sorted_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] column within slice j
    n_mask = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)  # [BK] rank index
    h_ptrs = buf_ptr + slice_id * stride_bs + tok[:, None] * stride_bt + offs_k[None, :]  # [BM, BK]
    b_ptrs = (
        b_ptr + slot.to(tl.int64) * R * n_out + offs_k[:, None] * n_out + offs_n[None, :]
    )  # [BK, BN], rows of B_j[slot] are rank indices
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        k_mask = offs_k < rank - k0
        ht = tl.load(h_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        bt = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        if UPCAST:  # the interpreter's dot mishandles bf16
            acc += tl.dot(ht.to(tl.float32), bt.to(tl.float32))
        else:
            acc += tl.dot(ht.to(bt.dtype), bt)
        h_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * n_out
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
    lora_b: Sequence[torch.Tensor],
    meta: LoRAKernelMeta,
    ranks: torch.Tensor,
    y: torch.Tensor,
    slice_offsets: Sequence[int],
    *,
    block_m: int = 32,
    block_n: int = 64,
    block_k: int = 16,
) -> None:
    """Triton expand, in place on ``y`` (see module doc).

    buf: [num_slices, T, R] (fp32 or y.dtype); lora_b: per slice [max_loras, R, n_j];
    y: [T, total_out]; slice_offsets: column offset of each slice in y.
    """
    _check_expand_args(buf, lora_b, meta, ranks, y, slice_offsets)
    if not meta.has_lora:
        return
    check_launch_device(y)
    R = lora_b[0].shape[1]
    widths = [b.shape[2] for b in lora_b]
    pad = MAX_SLICES - len(lora_b)
    b = [*lora_b, *[lora_b[0]] * pad]  # unused slices: never read (grid axis 1 stops first)
    n = [*widths, *[0] * pad]
    off = [*slice_offsets, *[0] * pad]
    max_n = max(widths)
    grid = (
        triton.cdiv(meta.max_num_tokens, block_m) * triton.cdiv(max_n, block_n),
        len(lora_b),
        meta.max_loras,
    )
    _jitted_expand_kernel(triton_interpreting())[grid](
        buf, b[0], b[1], b[2], y,
        meta.sorted_token_indices, meta.active_slots, meta.seg_lens, meta.seg_starts, ranks,
        n[0], n[1], n[2], off[0], off[1], off[2],
        max_n, R, buf.stride(0), buf.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=y.dtype == torch.bfloat16 and triton_interpreting(),
    )  # fmt: skip


def lora_expand_torch(
    buf: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    meta: LoRAKernelMeta,
    ranks: torch.Tensor,
    y: torch.Tensor,
    slice_offsets: Sequence[int],
) -> None:
    """Torch reference for ``lora_expand``: one matmul per segment and slice at the slot's rank."""
    _check_expand_args(buf, lora_b, meta, ranks, y, slice_offsets)
    if not meta.has_lora:
        return
    rank_list: list[int] = ranks.tolist()
    sorted_idx = meta.sorted_token_indices.to(torch.int64)  # [max_T]
    for slot, start, n in zip(
        meta.active_slot_list, meta.seg_start_list, meta.seg_len_list, strict=True
    ):
        r = rank_list[slot]
        if r == 0:
            continue
        idx = sorted_idx[start : start + n]  # [n] token rows of this segment
        for j, (b, off) in enumerate(zip(lora_b, slice_offsets, strict=True)):
            h = buf[j].index_select(0, idx)[:, :r].float()  # [n, r]
            d = h @ b[slot, :r].float()  # [n, n_j]
            cols = y[:, off : off + b.shape[2]]  # [T, n_j] view
            rows = cols.index_select(0, idx).float() + d  # [n, n_j], summed in fp32 like Triton
            cols.index_copy_(0, idx, rows.to(y.dtype))
