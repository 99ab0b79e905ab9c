"""Unified paged attention over a flat batch: prefill chunks and decodes in one Triton launch.

One module, as for every kernel: the Triton kernel, its launcher (shape/dtype/stride checks, early
return) and a plain-torch reference with the same signature.

The batch is the engine's flat batch (``engine/attention/base.py``): request ``i`` owns query rows
``query_start_loc[i] : query_start_loc[i + 1]``, its ``seq_lens[i]`` keys live in the paged cache
(this step's K/V already written), and its query tokens are the *last* ``q_len`` of those keys, so a
chunk with a cached prefix and a decode (``q_len == 1``) are the same case::

    key positions   0 .. ctx-1 (cached prefix) | ctx .. seq_len-1 (this step's chunk)
    query row r of the chunk sits at position ctx + r and sees keys 0 .. ctx + r (causal)

K and V are read in place through the block table (slot of position ``p``:
``block_table[p // block_size] * block_size + p % block_size``): nothing is gathered, nothing is
padded to the longest sequence.

Grid, computable on the host from shapes alone (no device -> host sync, graph-capturable)::

    axis 0: query blocks, at most  num_tokens // BLOCK_Q + num_seqs   (request i's blocks start at
            query_start_loc[i] // BLOCK_Q + i; a program finds its request by binary search and
            returns at once when it lies past its request's rows)
    axis 1: KV heads (a program handles the GROUP query heads of one KV head: GQA/MQA for free)
    axis 2: KV segments (split-KV, 1 = off)

A program's BLOCK_M = BLOCK_Q * GROUP_P rows are (query token, query head of the group) pairs, so
a decode with 8 query heads per KV head still fills a 16-row tile. With NUM_SEGMENTS > 1 each
program covers a share of the request's KV tiles and writes an unnormalised partial (acc, running
max, running sum) to fp32 scratch; ``_merge_segments_kernel`` combines them by log-sum-exp.
Head sizes that are not powers of 2 (80, 96) are masked up to the next power of 2.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.kernels.lora_shrink import HAS_TRITON, triton_interpreting

if HAS_TRITON:
    import triton
    import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MAX_SEGMENTS = 64
LOG2E = 1.4426950408889634


def _paged_attention_kernel(
    out_ptr: tl.tensor,  # [T, H, D]
    q_ptr: tl.tensor,  # [T, H, D] (any token/head strides, unit stride along D)
    k_cache_ptr: tl.tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr: tl.tensor,  # [num_blocks, block_size, H_kv, D]
    block_tables_ptr: tl.tensor,  # [B, W] int32
    seq_lens_ptr: tl.tensor,  # [B] int32
    query_start_ptr: tl.tensor,  # [B + 1] int32
    seg_acc_ptr: tl.tensor,  # [T, H, NUM_SEGMENTS, HEAD_DIM_P] fp32 (split-KV only)
    seg_max_ptr: tl.tensor,  # [T, H, NUM_SEGMENTS] fp32 (split-KV only), log2 domain
    seg_sum_ptr: tl.tensor,  # [T, H, NUM_SEGMENTS] fp32 (split-KV only)
    scale_log2: float,  # softmax scale * log2(e): exp2 instead of exp
    num_seqs: int,
    num_heads: int,
    stride_qt: int,
    stride_qh: int,
    stride_ot: int,
    stride_oh: int,
    stride_kb: int,
    stride_ks: int,
    stride_kh: int,
    stride_vb: int,
    stride_vs: int,
    stride_vh: int,
    stride_bt: int,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    INTERPRET: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no TF32: fp32 means fp32), else "tf32"
) -> None:
    qblock = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    # Builtins only (no tl.cdiv / tl.zeros / tl.max): triton.language's own @jit helpers fail
    # under TRITON_INTERPRET=1 when triton was imported before the variable was set.

    # The request of this query block: the last i with query_start[i] // BLOCK_Q + i <= qblock.
    lo: tl.int32 = 0  # typed: a loop-carried value must be a tensor when compiled
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= qblock:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local = qblock - (q_start // BLOCK_Q + seq)  # this program's block within its request
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # keys before this step's chunk (the cached prefix)

    offs_m = tl.arange(0, BLOCK_M)  # [BM] (query token, head in group) pairs
    q_idx = local * BLOCK_Q + offs_m // GROUP_P  # [BM] query row within the request's chunk
    head = kv_head * GROUP + offs_m % GROUP_P  # [BM] query head
    row_ok = (q_idx < q_len) & (offs_m % GROUP_P < GROUP)  # [BM]
    token = (q_start + q_idx).to(tl.int64)  # [BM] flat-batch row
    q_pos = ctx + q_idx  # [BM] absolute position: sees keys 0 ..= q_pos
    offs_d = tl.arange(0, HEAD_DIM_P)  # [Dp]
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BM, Dp]
    if UPCAST:  # the interpreter's dot mishandles bf16
        q = q.to(tl.float32)

    # keys this block needs: up to the position of its last query row
    last_row = local * BLOCK_Q + BLOCK_Q
    kv_end = tl.minimum(seq_len, ctx + tl.minimum(last_row, q_len))
    num_tiles = (kv_end + TILE_N - 1) // TILE_N
    tile_lo = 0
    tile_hi = num_tiles
    if NUM_SEGMENTS > 1:
        per_segment = (num_tiles + NUM_SEGMENTS - 1) // NUM_SEGMENTS
        tile_lo = segment * per_segment
        tile_hi = tl.minimum(num_tiles, tile_lo + per_segment)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)  # running sum of exp2
    acc = tl.full((BLOCK_M, HEAD_DIM_P), 0.0, tl.float32)  # [BM, Dp]
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)  # [TN] key positions
        n_ok = offs_n < kv_end
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)  # [TN]
        in_block = offs_n % BLOCK_SIZE  # [TN]
        k = tl.load(
            k_cache_ptr
            + block[None, :] * stride_kb
            + in_block[None, :] * stride_ks
            + kv_head * stride_kh
            + offs_d[:, None],
            mask=d_ok[:, None] & n_ok[None, :],
            other=0.0,
        )  # [Dp, TN]
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + in_block[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [TN, Dp]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BM, TN]
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])  # causal within the chunk
        s = tl.where(visible, s, float("-inf"))
        if INTERPRET:  # noqa: SIM108 (a constexpr branch: the GPU never compiles the other)
            tile_max = tl.reduce(s, 1, tl.standard._elementwise_max)  # [BM]
        else:
            tile_max = tl.max(s, 1)
        m_new = tl.maximum(m_i, tile_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key seen yet
        p = tl.exp2(s - m_safe[:, None])  # [BM, TN], 0 where not visible
        alpha = tl.exp2(m_i - m_safe)  # [BM], 0 while m_i is -inf
        if INTERPRET:  # noqa: SIM108
            p_sum = tl.reduce(p, 1, tl.standard._sum_combine)
        else:
            p_sum = tl.sum(p, 1)
        l_i = l_i * alpha + p_sum
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (token * num_heads + head) * NUM_SEGMENTS + segment  # [BM]
        tl.store(
            seg_acc_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :],
            acc,
            mask=row_ok[:, None] & (offs_d < HEAD_DIM_P)[None, :],
        )
        tl.store(seg_max_ptr + part, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + part, l_i, mask=row_ok)


def _merge_segments_kernel(
    out_ptr: tl.tensor,  # [T, H, D]
    seg_acc_ptr: tl.tensor,  # [T, H, NUM_SEGMENTS, HEAD_DIM_P] fp32
    seg_max_ptr: tl.tensor,  # [T, H, NUM_SEGMENTS] fp32, log2 domain
    seg_sum_ptr: tl.tensor,  # [T, H, NUM_SEGMENTS] fp32
    num_heads: int,
    stride_ot: int,
    stride_oh: int,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    SEGMENTS_P: tl.constexpr,
    INTERPRET: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SEGMENTS_P)  # [Sp]
    s_ok = offs_s < NUM_SEGMENTS
    offs_d = tl.arange(0, HEAD_DIM_P)  # [Dp]
    part = (token * num_heads + head) * NUM_SEGMENTS + offs_s  # [Sp]
    m = tl.load(seg_max_ptr + part, mask=s_ok, other=float("-inf"))  # [Sp]
    l_s = tl.load(seg_sum_ptr + part, mask=s_ok, other=0.0)  # [Sp]
    if INTERPRET:  # noqa: SIM108
        m_all = tl.reduce(m, 0, tl.standard._elementwise_max)
    else:
        m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m - m_all)  # [Sp], 0 for empty segments
    acc = tl.load(
        seg_acc_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :],
        mask=s_ok[:, None] & (offs_d < HEAD_DIM_P)[None, :],
        other=0.0,
    )  # [Sp, Dp]
    if INTERPRET:
        total = tl.reduce(w * l_s, 0, tl.standard._sum_combine)
        out = tl.reduce(acc * w[:, None], 0, tl.standard._sum_combine)  # [Dp]
    else:
        total = tl.sum(w * l_s, 0)
        out = tl.sum(acc * w[:, None], 0)
    out = out / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@functools.cache
def _jitted(interpret: bool) -> tuple[Any, Any]:
    # Built on first launch, not at import: TRITON_INTERPRET is read when triton.jit runs.
    return triton.jit(_paged_attention_kernel), triton.jit(_merge_segments_kernel)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    if q.dim() != 3 or q.dtype not in SUPPORTED_DTYPES or q.stride(2) != 1:
        raise ValueError(
            f"q must be [T, H, D] fp32/fp16/bf16 with unit stride along D, got {q.dtype} "
            f"{tuple(q.shape)} strides {q.stride()}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head size {head_dim} is above the kernel's {MAX_HEAD_DIM}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[3] != head_dim or c.dtype != q.dtype or c.stride(3) != 1:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, H_kv, {head_dim}] {q.dtype} with unit "
                f"stride along the head size, got {c.dtype} {tuple(c.shape)}"
            )
        if c.device != q.device:
            raise ValueError(f"{name} is on {c.device} but q is on {q.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {out.dtype} {out.shape}")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
        or block_tables.dtype != torch.int32
        or block_tables.stride(1) != 1
    ):
        raise ValueError(
            f"block_tables must be int32 [B={num_seqs}, W] with unit column stride, got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.dtype != torch.int32 or num_seqs < 0:
        raise ValueError(f"seq_lens must be int32 [B], got {seq_lens.dtype} {seq_lens.shape}")
    if query_start_loc.dtype != torch.int32 or tuple(query_start_loc.shape) != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be int32 [B + 1 = {num_seqs + 1}], got "
            f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if query_start_loc.device != q.device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device}, q on {q.device}")


@dataclass(frozen=True)
class TileConfig:
    block_q: int  # query tokens per program
    block_m: int  # rows per program: block_q * (query heads per KV head, to a power of 2)
    tile_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int


def tile_config(max_query_len: int, group: int, head_dim: int) -> TileConfig:
    """16-row tiles for decode batches, 64 rows for prefill chunks (``tl.dot`` needs at least 16
    in every dimension on the GPU). Large head sizes get narrower key tiles and fewer pipeline
    stages so that q, and the K/V tiles in flight, fit in shared memory."""
    group_p = _next_pow2(group)
    head_dim_p = max(16, _next_pow2(head_dim))
    if max_query_len <= 1:
        block_m = max(16, group_p)
        return TileConfig(block_m // group_p, block_m, 32, 4, 3 if head_dim_p <= 128 else 2)
    block_m = max(64, group_p)
    tile_n = 64 if head_dim_p <= 128 else 32
    num_warps = 4 if head_dim_p <= 64 else 8
    return TileConfig(block_m // group_p, block_m, tile_n, num_warps, 3 if head_dim_p <= 128 else 2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    scale: float | None = None,
    num_segments: int = 1,
) -> torch.Tensor:
    """Causal paged attention for the flat batch, written into ``out``; returns ``out``.

    q, out: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, H_kv, D] (this step's K/V
    already written); block_tables: [B, W] int32; seq_lens: [B] int32 keys per request (cached
    prefix + this step's rows); query_start_loc: [B + 1] int32 with query_start_loc[B] == T.
    ``max_query_len`` (a host int, an upper bound is fine) picks the tile shape; ``num_segments``
    > 1 splits each request's KV range into that many parallel segments merged by log-sum-exp
    (long-context decode batches with too few programs to fill the GPU).
    """
    _check_args(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc)
    if not 1 <= num_segments <= MAX_SEGMENTS:
        raise ValueError(f"num_segments must be in 1..{MAX_SEGMENTS}, got {num_segments}")
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if not HAS_TRITON:
        raise RuntimeError("the Triton attention kernel needs the `triton` package")
    interpret = triton_interpreting()
    if not q.is_cuda and not interpret:
        raise ValueError(
            f"the Triton attention kernel needs CUDA tensors (got {q.device}); on the CPU use "
            "paged_attention_torch or set TRITON_INTERPRET=1"
        )
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    group_p = _next_pow2(group)
    head_dim_p = max(16, _next_pow2(head_dim))
    tiles = tile_config(max_query_len, group, head_dim)
    grid = (num_tokens // tiles.block_q + num_seqs, num_kv_heads, num_segments)
    if num_segments > 1:
        seg_acc = torch.empty(
            (num_tokens, num_heads, num_segments, head_dim_p), dtype=torch.float32, device=q.device
        )  # [T, H, S, Dp]
        seg_max = torch.empty((num_tokens, num_heads, num_segments), dtype=torch.float32,
                              device=q.device)  # fmt: skip
        seg_sum = torch.empty_like(seg_max)  # [T, H, S]
    else:  # never read: any fp32 tensor will do
        seg_acc = seg_max = seg_sum = torch.empty(1, dtype=torch.float32, device=q.device)
    attend, merge = _jitted(interpret)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    attend[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        seg_acc, seg_max, seg_sum,
        scale * LOG2E, num_seqs, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, GROUP=group, GROUP_P=group_p,
        BLOCK_Q=tiles.block_q, BLOCK_M=tiles.block_m, TILE_N=tiles.tile_n, BLOCK_SIZE=block_size,
        NUM_SEGMENTS=num_segments, INTERPRET=interpret,
        UPCAST=interpret and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if num_segments > 1:
        merge[(num_tokens, num_heads)](
            out, seg_acc, seg_max, seg_sum, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SEGMENTS=num_segments,
            SEGMENTS_P=_next_pow2(num_segments), INTERPRET=interpret,
        )  # fmt: skip
    return out


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    scale: float | None = None,
    num_segments: int = 1,
) -> torch.Tensor:
    """Torch reference for ``paged_attention`` (same arguments): one request at a time, fp32."""
    _check_args(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    starts: list[int] = query_start_loc.tolist()
    lens: list[int] = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        t0, t1 = starts[i], starts[i + 1]
        if t1 == t0:
            continue
        ctx = seq_len - (t1 - t0)
        pos = torch.arange(seq_len, device=q.device)  # [S]
        slots = block_tables[i].long()[pos // block_size] * block_size + pos % block_size  # [S]
        keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()  # [S, H_kv, D]
        vals = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
        keys = keys.repeat_interleave(group, dim=1)  # [S, H, D]
        vals = vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q[t0:t1].float(), keys) * scale  # [H, L, S]
        q_pos = ctx + torch.arange(t1 - t0, device=q.device)  # [L]
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[t0:t1] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), vals).to(out.dtype)
    return out
