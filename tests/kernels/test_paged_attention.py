"""The Triton paged-attention kernel (interpreted on the CPU) against its torch reference, and the
reference against a naive per-request attention over unpaged keys."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from loraplex.kernels.paged_attention import paged_attention, paged_attention_torch

triton = pytest.importorskip("triton")

TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernels on the CPU; they are jitted at first launch, so this works even when
    another module imported triton first."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@dataclass
class Batch:
    q: torch.Tensor  # [T, H, D], a strided view (the first H heads of a [T, H + 1, D] tensor)
    k_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D], block 0 (null) zero
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, W] int32, shuffled block ids, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    keys: list[torch.Tensor]  # per request [seq_len, H_kv, D], unpaged
    values: list[torch.Tensor]
    max_query_len: int


def make_batch(
    seqs: list[tuple[int, int]],  # (cached prefix length, query length) per request
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """Every request's keys (prefix and this step's) already in the cache, at shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    seq_lens = [s + n for s, n in seqs]
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3  # block 0 is null, two never used
    ids = rng.permutation(np.arange(1, num_blocks)).tolist()
    width = max(need) + 1
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    keys, values = [], []
    for i, n in enumerate(seq_lens):
        blocks = [ids.pop() for _ in range(need[i])]
        tables[i, : need[i]] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(n):
            k_cache[blocks[p // block_size], p % block_size] = k[p]
            v_cache[blocks[p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    qlens = [n for _, n in seqs]
    qsl = torch.tensor([0, *np.cumsum(qlens).tolist()], dtype=torch.int32)
    q_all = torch.randn(int(qsl[-1]), heads + 1, head_dim, generator=gen).to(dtype)
    return Batch(
        q_all[:, :heads],
        k_cache,
        v_cache,
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        qsl,
        keys,
        values,
        max(qlens),
    )


def run(batch: Batch, fn=paged_attention, **kw: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype)
    return fn(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        out,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        **{"max_query_len": batch.max_query_len, **kw},
    )


def naive(batch: Batch) -> torch.Tensor:
    """Per request: causal attention of its query rows (the last q_len keys) over its keys."""
    outs = []
    starts = batch.query_start_loc.tolist()
    for i, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.q[starts[i] : starts[i + 1]].double()  # [L, H, D]
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, 1)
        vv = v.double().repeat_interleave(group, 1)
        s = torch.einsum("lhd,shd->hls", q, kk) / math.sqrt(q.shape[-1])  # [H, L, S]
        q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hls,shd->lhd", s.softmax(-1), vv))
    return torch.cat(outs).to(batch.q.dtype)


def mixed(bs: int) -> list[tuple[int, int]]:
    return [
        (5, 1),  # decode
        (0, 7),  # first prefill chunk
        (2 * bs - 1, 1),  # decode whose length is a block multiple
        (0, 1),  # a one-token sequence
        (bs + 3, 5),  # later chunk after a cached prefix, not block-aligned
        (0, bs),  # a one-block sequence (a whole-block first chunk)
        (bs, 3),  # later chunk starting on a block boundary
        (3 * bs - 1, 1),  # decode, block multiple, last row of the batch
    ]


# GQA 8:1, MHA, GQA 2:1 and 3:1 (a group that is not a power of 2)
HEADS = [(8, 1, 32), (2, 2, 16), (4, 2, 64), (3, 1, 16)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("block_size", [4, 16, 6])
def test_mixed_batch_matches_the_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    batch = make_batch(mixed(block_size), heads, kv_heads, head_dim, block_size, seed=block_size)
    assert not batch.q.is_contiguous()
    ref = run(batch, paged_attention_torch)
    torch.testing.assert_close(ref, naive(batch), **TOL[torch.float32])
    torch.testing.assert_close(run(batch), ref, **TOL[torch.float32])


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_every_head_size(head_dim: int) -> None:
    batch = make_batch([(3, 1), (0, 4), (5, 2)], 2, 1, head_dim, 4, seed=head_dim)
    torch.testing.assert_close(run(batch), naive(batch), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype: torch.dtype) -> None:
    batch = make_batch([(6, 1), (2, 5), (0, 3)], 4, 2, 32, 4, dtype=dtype, seed=3)
    out = run(batch)
    assert out.dtype == dtype
    torch.testing.assert_close(out, run(batch, paged_attention_torch), **TOL[dtype])


@pytest.mark.parametrize("num_segments", [3, 4, 16])
def test_split_kv_decode_matches_the_reference(num_segments: int) -> None:
    # long-ish contexts for the interpreter; 16 segments leave some segments without a tile
    batch = make_batch([(70, 1), (9, 1), (0, 1), (130, 1)], 4, 2, 32, 16, seed=num_segments)
    torch.testing.assert_close(
        run(batch, num_segments=num_segments), naive(batch), **TOL[torch.float32]
    )


def test_split_kv_on_a_mixed_batch() -> None:
    batch = make_batch(mixed(4), 4, 1, 16, 4, seed=11)
    torch.testing.assert_close(run(batch, num_segments=2), naive(batch), **TOL[torch.float32])


def test_max_query_len_is_only_a_tile_choice() -> None:
    # a decode batch launched with prefill tiles (an upper bound is fine) gives the same result
    batch = make_batch([(5, 1), (17, 1), (0, 1)], 8, 1, 32, 4, seed=5)
    torch.testing.assert_close(run(batch), run(batch, max_query_len=64), **TOL[torch.float32])


def test_launcher_checks_and_early_return(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_batch([(2, 1)], 2, 1, 16, 4)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_attention(
            batch.q, batch.k_cache, batch.v_cache, torch.empty_like(batch.q),
            batch.block_tables.long(), batch.seq_lens, batch.query_start_loc, max_query_len=1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="not a multiple"):
        q = torch.randn(1, 3, 16)
        kc = torch.zeros(4, 4, 2, 16)
        paged_attention(
            q, kc, kc, torch.empty_like(q), batch.block_tables, batch.seq_lens,
            batch.query_start_loc, max_query_len=1,
        )  # fmt: skip
    empty = torch.empty(0, 2, 16)
    out = paged_attention(
        empty, batch.k_cache, batch.v_cache, empty, batch.block_tables[:0], batch.seq_lens[:0],
        batch.query_start_loc[:1], max_query_len=1,
    )  # fmt: skip
    assert out is empty
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        run(batch)
