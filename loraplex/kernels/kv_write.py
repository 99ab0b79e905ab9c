"""Write one step's K/V into the paged cache at their slots (vLLM's ``reshape_and_cache``).

One module: the Triton kernel, its launcher and a torch reference. Row ``t`` of ``k``/``v``
(``[T, H_kv, D]``) goes to slot ``slot_mapping[t]`` = ``block * block_size + offset`` of the layer
caches ``[num_blocks, block_size, H_kv, D]``. A negative slot (``PAD_SLOT``) writes nothing: the
rows a CUDA graph pads a decode batch with never touch the cache (the null block stays zero).

Rope is not fused here: the model applies rope to q and k together in one call before attention
(``models/llama.py``), so fusing it would save one read of k per layer and cost a second rope path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from loraplex.kernels.lora_shrink import HAS_TRITON, triton_interpreting

if HAS_TRITON:
    import triton
    import triton.language as tl

PAD_SLOT = -1


def _kv_write_kernel(
    k_ptr: tl.tensor,  # [T, H_kv, D]
    v_ptr: tl.tensor,  # [T, H_kv, D]
    k_cache_ptr: tl.tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr: tl.tensor,
    slot_ptr: tl.tensor,  # [T] int64
    stride_kt: int,
    stride_kh: int,
    stride_vt: int,
    stride_vh: int,
    stride_cb: int,
    stride_cs: int,
    stride_ch: int,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P)  # [Hp]
    offs_d = tl.arange(0, HEAD_DIM_P)  # [Dp]
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [Hp, Dp]
    dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@functools.cache
def _jitted(interpret: bool) -> Any:
    # Built on first launch, not at import: TRITON_INTERPRET is read when triton.jit runs.
    return triton.jit(_kv_write_kernel)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k and v must be [T, H_kv, D] alike, got {k.shape} {v.shape}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must have unit stride along the head size")
    want = k.shape[1:]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[2:] != want or c.dtype != k.dtype:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, {want[0]}, {want[1]}] {k.dtype}, "
                f"got {c.dtype} {tuple(c.shape)}"
            )
        if c.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride along the head size")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(
            f"slot_mapping must be int64 [T={k.shape[0]}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slot_mapping)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device} but k is on {k.device}")


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton: ``k_cache/v_cache[slot // bs, slot % bs] = k/v[t]`` for every row with slot >= 0."""
    _check_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if not HAS_TRITON:
        raise RuntimeError("the Triton KV write kernel needs the `triton` package")
    interpret = triton_interpreting()
    if not k.is_cuda and not interpret:
        raise ValueError(
            f"the Triton KV write kernel needs CUDA tensors (got {k.device}); on the CPU use "
            "write_kv_torch or set TRITON_INTERPRET=1"
        )
    _jitted(interpret)[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_P=_next_pow2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_P=_next_pow2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip


def write_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference for ``write_kv`` (same arguments; negative slots write nothing)."""
    _check_args(k, v, k_cache, v_cache, slot_mapping)
    keep = (slot_mapping >= 0).nonzero().view(-1)  # [T'] rows that write
    slots = slot_mapping.index_select(0, keep)  # [T']
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.index_select(0, keep))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.index_select(0, keep))
