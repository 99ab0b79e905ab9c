"""LoRA shrink (Punica SGMV, first half): ``out[j, t] = scale[s] * x[t] @ A_j[s].T`` per segment.

One module: the Triton kernel, its launcher and a plain-torch reference with the same signature.
Only rows of tokens with a slot (≥ 0) and columns below the slot's rank are written (columns of
the last partial tile are written as exact zeros); the expand never reads anything else.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from loraplex.kernels.meta import LoRAKernelMeta

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # torch-only installs: the reference paths still work
    HAS_TRITON = False

MAX_SLICES = 3  # qkv_proj = q|k|v is the widest packed layer
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_launch_device(t: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("the Triton LoRA kernels need the `triton` package")
    if not t.is_cuda and not triton_interpreting():
        raise ValueError(
            f"the Triton LoRA kernels need a CUDA tensor (got {t.device}); on the CPU use the "
            "torch path or set TRITON_INTERPRET=1"
        )


def check_meta_args(
    meta: LoRAKernelMeta, num_tokens: int, ranks: torch.Tensor, device: torch.device
) -> None:
    if num_tokens != meta.num_tokens:
        raise ValueError(
            f"batch has {num_tokens} tokens but meta was prepared for {meta.num_tokens}"
        )
    if ranks.dtype != torch.int32 or tuple(ranks.shape) != (meta.max_loras,):
        raise ValueError(
            f"ranks must be int32 [{meta.max_loras}], got {ranks.dtype} {tuple(ranks.shape)}"
        )
    for name, t in (("ranks", ranks), ("meta", meta.seg_lens)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the batch is on {device}")


def check_stacks(
    name: str, stacks: Sequence[torch.Tensor], dtype: torch.dtype, max_loras: int
) -> None:
    if not 1 <= len(stacks) <= MAX_SLICES:
        raise ValueError(f"{name} needs 1 to {MAX_SLICES} slices, got {len(stacks)}")
    for j, w in enumerate(stacks):
        if w.dim() != 3 or w.shape[0] != max_loras:
            raise ValueError(
                f"{name}[{j}] must be [max_loras={max_loras}, ., .], got {tuple(w.shape)}"
            )
        if w.dtype != dtype:
            raise ValueError(f"{name}[{j}] is {w.dtype}, expected {dtype}")
        if not w.is_contiguous():
            raise ValueError(f"{name}[{j}] must be contiguous")


def _check_shrink_args(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    meta: LoRAKernelMeta,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
) -> None:
    if x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be 2-D [T, in] fp32/fp16/bf16, got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dimension")
    check_meta_args(meta, x.shape[0], ranks, x.device)
    check_stacks("lora_a", lora_a, x.dtype, meta.max_loras)
    R, K = lora_a[0].shape[1], lora_a[0].shape[2]
    for j, a in enumerate(lora_a):
        if tuple(a.shape[1:]) != (R, K) or x.shape[1] != K:
            raise ValueError(
                f"lora_a[{j}] must be [max_loras, {R}, in={x.shape[1]}], got {tuple(a.shape)}"
            )
    if scales.dtype != torch.float32 or tuple(scales.shape) != (meta.max_loras,):
        raise ValueError(
            f"scales must be float32 [{meta.max_loras}], got {scales.dtype} {tuple(scales.shape)}"
        )
    want = (len(lora_a), x.shape[0], R)
    if tuple(out.shape) != want or out.dtype not in (torch.float32, x.dtype):
        raise ValueError(
            f"out must be {list(want)} float32 or {x.dtype}, got {out.dtype} {tuple(out.shape)}"
        )
    if out.stride(2) != 1:
        raise ValueError("out must be contiguous along its last dimension")


# Block arithmetic, one program per (token tile, rank tile) × slice × segment:
#
#   grid = (cdiv(max_num_tokens, BM) * cdiv(R, BN),  num_slices,  max_loras)
#            └ pid_m = tile of the segment's rows     └ slice j    └ segment i
#              pid_n = tile of rank columns
#
#   x rows (gathered via sorted_token_indices)   A_j[slot]^T           out[j] rows (scattered)
#   [BM, K] ── K loop in BK steps ──────────▶  [K, BN]  ──▶  acc [BM, BN] fp32 * scale[slot]
#
# The grid never depends on the batch: a program whose segment is unused (slot -1), whose rows
# lie past the segment's length, or whose columns lie past the slot's rank returns at once.
def _lora_shrink_kernel(
    x_ptr: tl.tensor,
    a0_ptr: tl.tensor,
    a1_ptr: tl.tensor,
    a2_ptr: tl.tensor,
    out_ptr: tl.tensor,
    sorted_ptr: tl.tensor,
    active_ptr: tl.tensor,
    seg_lens_ptr: tl.tensor,
    seg_starts_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    scales_ptr: tl.tensor,
    K: int,
    R: int,
    stride_xt: int,
    stride_os: int,
    stride_ot: int,
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
    # Builtins only: a @jit helper of triton.language (tl.cdiv, tl.zeros) fails under
    # TRITON_INTERPRET=1 when triton was imported before the variable was set.
    n_tiles = (R + BLOCK_N - 1) // BLOCK_N
    pid_m = pid_mn // n_tiles
    pid_n = pid_mn % n_tiles
    if pid_m * BLOCK_M >= seg_len:
        return
    if pid_n * BLOCK_N >= rank:
        return
    a_ptr = a0_ptr
    if slice_id == 1:
        a_ptr = a1_ptr
    if slice_id == 2:
        a_ptr = a2_ptr

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row within the segment
    m_mask = offs_m < seg_len
    seg_start = tl.load(seg_starts_ptr + seg)
    tok = tl.load(sorted_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rank column
    n_mask = offs_n < rank
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]  # [BM, BK]
    a_ptrs = a_ptr + slot.to(tl.int64) * R * K + offs_n[None, :] * K + offs_k[:, None]  # [BK, BN]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        at = tl.load(a_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        if UPCAST:  # the interpreter's dot mishandles bf16
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, at)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    acc *= tl.load(scales_ptr + slot)
    out_ptrs = out_ptr + slice_id * stride_os + tok[:, None] * stride_ot + offs_n[None, :]
    tl.store(
        out_ptrs,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & (offs_n < R)[None, :],
    )


@functools.cache
def _jitted_shrink_kernel(interpret: bool) -> Any:
    # Built on first launch, not at import: TRITON_INTERPRET is read when triton.jit runs
    # (the flag keys the cache so a later change of mode gets its own kernel).
    return triton.jit(_lora_shrink_kernel)


def lora_shrink(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    meta: LoRAKernelMeta,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    *,
    block_m: int = 32,
    block_n: int = 16,
    block_k: int = 64,
) -> None:
    """Triton shrink: ``out[j, t, :rank] = scale[s] * x[t] @ A_j[s, :rank].T`` (see module doc).

    x: [T, in]; lora_a: per slice [max_loras, R, in]; out: [num_slices, T, R] (fp32 or x.dtype).
    """
    _check_shrink_args(x, lora_a, meta, ranks, scales, out)
    if not meta.has_lora:
        return
    check_launch_device(x)
    R, K = lora_a[0].shape[1], lora_a[0].shape[2]
    a = [*lora_a, *[lora_a[0]] * (MAX_SLICES - len(lora_a))]  # unused pointers: never read
    grid = (
        triton.cdiv(meta.max_num_tokens, block_m) * triton.cdiv(R, block_n),
        len(lora_a),
        meta.max_loras,
    )
    _jitted_shrink_kernel(triton_interpreting())[grid](
        x, a[0], a[1], a[2], out,
        meta.sorted_token_indices, meta.active_slots, meta.seg_lens, meta.seg_starts,
        ranks, scales,
        K, R, x.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=x.dtype == torch.bfloat16 and triton_interpreting(),
    )  # fmt: skip


def lora_shrink_torch(
    x: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    meta: LoRAKernelMeta,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Torch reference for ``lora_shrink``: one matmul per segment and slice at the slot's rank."""
    _check_shrink_args(x, lora_a, meta, ranks, scales, out)
    if not meta.has_lora:
        return
    rank_list: list[int] = ranks.tolist()
    scale_list: list[float] = scales.tolist()
    sorted_idx = meta.sorted_token_indices.to(torch.int64)  # [max_T]
    for slot, start, n in zip(
        meta.active_slot_list, meta.seg_start_list, meta.seg_len_list, strict=True
    ):
        r = rank_list[slot]
        if r == 0:
            continue
        idx = sorted_idx[start : start + n]  # [n] token rows of this segment
        xs = x.index_select(0, idx).float()  # [n, in]
        for j, a in enumerate(lora_a):
            h = (xs @ a[slot, :r].float().T) * scale_list[slot]  # [n, r]
            out[j, :, :r].index_copy_(0, idx, h.to(out.dtype))
