"""LoRA shrink (Punica SGMV, first half) over the page pool: ``buf[j, t, :r] = x[t] @ A.T``.

``A = lora_a[j][pages[j, s, :r]]`` is the ``[r, in]`` matrix of slot ``s = token_slots[t]`` in
slice ``j`` at its own rank ``r = ranks[j, s]``, read row by row through the page index (rows may
lie anywhere in the pool, in any order; see ``lora_weights``). PEFT scaling lives in B.

One module: the Triton kernel, its launcher and a plain-torch reference with the same signature.
Only rows of tokens with a slot (≥ 0) and rank columns of tiles that start below the slot's rank
are written (columns of the last partial tile past the rank are written as exact zeros); the
expand never reads anything else.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from loraplex.kernels.lora_weights import LoRALayerWeights
from loraplex.kernels.meta import LoRAKernelMeta

try:
    import triton
    import triton.language as tl

    # The combine function of tl.sum / tl.cumsum. Used through the builtins tl.reduce and
    # tl.associative_scan because tl.sum and tl.cumsum are @jit helpers, which fail under
    # TRITON_INTERPRET=1 when triton was imported before the variable was set; the interpreter
    # recognises this function and runs numpy's sum / cumsum for it.
    from triton.language.standard import _sum_combine

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


def check_weights_and_meta(
    weights: LoRALayerWeights, meta: LoRAKernelMeta, num_tokens: int, device: torch.device
) -> None:
    """What both kernels need of the weights and the step's meta, beyond their own tensors."""
    if not 1 <= weights.num_slices <= MAX_SLICES:
        raise ValueError(
            f"the LoRA kernels take 1 to {MAX_SLICES} slices, got {weights.num_slices}"
        )
    if weights.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"adapter pools must be fp32/fp16/bf16, got {weights.dtype}")
    if weights.max_loras != meta.max_loras:
        raise ValueError(
            f"the page index has {weights.max_loras} slots but meta was built for max_loras="
            f"{meta.max_loras}"
        )
    if num_tokens != meta.num_tokens:
        raise ValueError(
            f"batch has {num_tokens} tokens but meta was prepared for {meta.num_tokens}"
        )
    if weights.device != device or meta.seg_lens.device != device:  # tensor devices: indexed
        raise ValueError(
            f"the batch is on {device}, the adapter pools on {weights.device}, meta on "
            f"{meta.seg_lens.device}"
        )


def check_workspace(name: str, buf: torch.Tensor, weights: LoRALayerWeights, T: int) -> None:
    want = (weights.num_slices, T, weights.max_rank)
    if tuple(buf.shape) != want or buf.dtype not in (torch.float32, weights.dtype):
        raise ValueError(
            f"{name} must be {list(want)} float32 or {weights.dtype}, got {buf.dtype} "
            f"{tuple(buf.shape)}"
        )
    if buf.stride(2) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension")
    if buf.device != weights.device:
        raise ValueError(f"{name} is on {buf.device}, the adapter pools on {weights.device}")


def _check_shrink_args(
    x: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta, buf: torch.Tensor
) -> None:
    if x.dim() != 2 or x.dtype != weights.dtype:
        raise ValueError(
            f"x must be 2-D [T, in] {weights.dtype} like the adapter pools, got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dimension")
    if x.shape[1] != weights.in_features:
        raise ValueError(f"x has {x.shape[1]} features, lora_a has {weights.in_features}")
    check_weights_and_meta(weights, meta, x.shape[0], x.device)
    check_workspace("buf", buf, weights, x.shape[0])


def num_tile_rows(num_tokens: int, max_loras: int, block_m: int) -> int:
    """Grid rows enough for every (segment, row tile): each segment adds at most one partial
    tile, and there are at most min(T, max_loras) segments. Depends on shapes only."""
    return -(-num_tokens // block_m) + min(num_tokens, max_loras)


# Block arithmetic, one program per (row tile, rank tile) × slice:
#
#   grid = ((cdiv(T, BM) + min(T, max_loras)) * cdiv(R, BN),  num_slices)
#            └ pid_m: the step's row tiles, segment by segment     └ slice j
#              pid_n: tile of rank columns
#
#   pid_m → (segment i, tile within it) by a prefix sum of cdiv(seg_lens, BM) (in the kernel:
#   the grid depends on shapes only, never on the step's segments)
#
#   x rows (gathered via sorted_token_indices)   A^T: pool rows pages[j, slot, cols]   buf[j] rows
#   [BM, K] ── K loop in BK steps ──────────▶  [K, BN] ─────────────────────────▶  acc [BM, BN]
#
# A program past the last tile, or whose columns start at or past the slot's rank in slice j,
# returns at once. Page entries past the rank are never loaded.
def _lora_shrink_kernel(
    x_ptr: tl.tensor,
    a0_ptr: tl.tensor,
    a1_ptr: tl.tensor,
    a2_ptr: tl.tensor,
    buf_ptr: tl.tensor,
    sorted_ptr: tl.tensor,
    active_ptr: tl.tensor,
    seg_lens_ptr: tl.tensor,
    seg_starts_ptr: tl.tensor,
    pages_ptr: tl.tensor,
    ranks_ptr: tl.tensor,
    K: int,
    R: int,
    max_loras: int,
    stride_xt: int,
    stride_bs: int,
    stride_bt: int,
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
    # Builtins only: a @jit helper of triton.language (tl.cdiv, tl.zeros, tl.sum) fails under
    # TRITON_INTERPRET=1 when triton was imported before the variable was set.
    n_tiles = (R + BLOCK_N - 1) // BLOCK_N
    pid_m = pid_mn // n_tiles
    pid_n = pid_mn % n_tiles
    # Segment of row tile pid_m: active segments come first, so the running tile count is a
    # prefix sum over them; unused segments (length 0) add no tiles.
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
    if pid_n * BLOCK_N >= rank:
        return
    a_ptr = a0_ptr
    if slice_id == 1:
        a_ptr = a1_ptr
    if slice_id == 2:
        a_ptr = a2_ptr

    seg_len = tl.load(seg_lens_ptr + seg).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row within the segment
    m_mask = offs_m < seg_len
    seg_start = tl.load(seg_starts_ptr + seg).to(tl.int64)
    tok = tl.load(sorted_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rank column
    n_mask = offs_n < rank
    page_row = pages_ptr + slice_id * stride_pj + slot * stride_ps
    pages = tl.load(page_row + offs_n * stride_pk, mask=n_mask, other=0).to(tl.int64)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]  # [BM, BK]
    a_ptrs = a_ptr + pages[None, :] * K + offs_k[:, None]  # [BK, BN]: column c is pool row pages[c]
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
    out_ptrs = buf_ptr + slice_id * stride_bs + tok[:, None] * stride_bt + offs_n[None, :]
    tl.store(
        out_ptrs,
        acc.to(buf_ptr.dtype.element_ty),
        mask=m_mask[:, None] & (offs_n < R)[None, :],
    )


@functools.cache
def _jitted_shrink_kernel(interpret: bool) -> Any:
    # Built on first launch, not at import: TRITON_INTERPRET is read when triton.jit runs
    # (the flag keys the cache so a later change of mode gets its own kernel).
    return triton.jit(_lora_shrink_kernel)


def pool_pointers(pools: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The slices' pools padded to MAX_SLICES (the unused pointers are never read)."""
    return [*pools, *[pools[0]] * (MAX_SLICES - len(pools))]


def lora_shrink(
    x: torch.Tensor,
    weights: LoRALayerWeights,
    meta: LoRAKernelMeta,
    buf: torch.Tensor,
    *,
    block_m: int = 32,
    block_n: int = 16,
    block_k: int = 64,
) -> None:
    """Triton shrink: ``buf[j, t, :r] = x[t] @ lora_a[j][pages[j, s, :r]].T`` (see module doc).

    x: [T, in]; buf: [num_slices, T, max_rank] (fp32 or x.dtype), e.g. ``meta.workspace``.
    """
    _check_shrink_args(x, weights, meta, buf)
    if not meta.has_lora:
        return
    check_launch_device(x)
    T, R = x.shape[0], weights.max_rank
    a = pool_pointers(weights.lora_a)
    pages, ranks = weights.pages, weights.ranks
    grid = (
        num_tile_rows(T, meta.max_loras, block_m) * triton.cdiv(R, block_n),
        weights.num_slices,
    )
    _jitted_shrink_kernel(triton_interpreting())[grid](
        x, a[0], a[1], a[2], buf,
        meta.sorted_token_indices, meta.active_slots, meta.seg_lens, meta.seg_starts,
        pages, ranks,
        weights.in_features, R, meta.max_loras,
        x.stride(0), buf.stride(0), buf.stride(1),
        pages.stride(0), pages.stride(1), pages.stride(2), ranks.stride(0), ranks.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        LORAS_P2=max(16, triton.next_power_of_2(meta.max_loras)),
        UPCAST=x.dtype == torch.bfloat16 and triton_interpreting(),
    )  # fmt: skip


def lora_shrink_torch(
    x: torch.Tensor, weights: LoRALayerWeights, meta: LoRAKernelMeta, buf: torch.Tensor
) -> None:
    """Torch reference for ``lora_shrink``: one matmul per segment and slice at the slot's rank
    in that slice, A gathered from the pool through the page index."""
    _check_shrink_args(x, weights, meta, buf)
    if not meta.has_lora:
        return
    ranks: list[list[int]] = weights.ranks.tolist()  # [num_slices][max_loras]
    sorted_idx = meta.sorted_token_indices.to(torch.int64)  # [max_T]
    for slot, start, n in zip(
        meta.active_slot_list, meta.seg_start_list, meta.seg_len_list, strict=True
    ):
        idx = sorted_idx[start : start + n]  # [n] token rows of this segment
        xs = x.index_select(0, idx).float()  # [n, in]
        for j, pool in enumerate(weights.lora_a):
            r = ranks[j][slot]
            if r == 0:
                continue
            rows = weights.pages[j, slot, :r].to(torch.int64)  # [r] pool rows
            h = xs @ pool.index_select(0, rows).float().T  # [n, r]
            buf[j, :, :r].index_copy_(0, idx, h.to(buf.dtype))
