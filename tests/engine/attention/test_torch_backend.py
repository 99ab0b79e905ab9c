"""TorchPagedAttention against a naive per-sequence causal attention."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.engine.attention.torch_backend import TorchAttentionMetadata, TorchPagedAttention
from tests.utils.model_fixtures import layout_for

BLOCK = 4
NUM_BLOCKS = 40


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [L, H, D] at positions start..start+L-1; k, v [start+L, H_kv, D] -> [L, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q, k) / math.sqrt(q.shape[-1])  # [H, L, S]
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (4, 1)])
def test_mixed_batch_matches_naive(heads: int, kv_heads: int) -> None:
    torch.manual_seed(heads * 10 + kv_heads)
    dim = 8
    backend = TorchPagedAttention(torch.device("cpu"), torch.float32)
    cache = torch.zeros(backend.kv_cache_shape(NUM_BLOCKS, BLOCK, kv_heads, dim))
    # (start, query length, block table): decodes, a first chunk, later chunks, a 1-token chunk
    seqs = [
        (9, 1, [5, 12, 3]),
        (0, 7, [20, 2]),
        (6, 5, [7, 31, 8]),
        (13, 1, [1, 9, 33, 15]),
        (4, 9, [11, 4, 25, 26]),
        (2, 1, [30]),
    ]
    full_k, full_v, chunks = [], [], []
    for start, qlen, table in seqs:
        k = torch.randn(start + qlen, kv_heads, dim)
        v = torch.randn(start + qlen, kv_heads, dim)
        for p in range(start):  # earlier steps' KV already in the cache
            cache[0, table[p // BLOCK], p % BLOCK] = k[p]
            cache[1, table[p // BLOCK], p % BLOCK] = v[p]
        full_k.append(k)
        full_v.append(v)
        chunks.append((list(range(qlen)), start, table))
    _, _, layout = layout_for(chunks, BLOCK)
    md = backend.build_metadata(layout)
    assert isinstance(md, TorchAttentionMetadata)
    assert md.num_decodes == 3 and len(md.prefills) == 3
    q = torch.randn(int(layout.query_lens.sum()), heads, dim)
    new_k = torch.cat([k[s:] for k, (s, _, _) in zip(full_k, seqs, strict=True)])
    new_v = torch.cat([v[s:] for v, (s, _, _) in zip(full_v, seqs, strict=True)])

    out = backend.forward(0, q, new_k, new_v, cache, md)

    row = 0
    for (start, qlen, _), k, v in zip(seqs, full_k, full_v, strict=True):
        expected = naive(q[row : row + qlen], k, v, start)
        torch.testing.assert_close(out[row : row + qlen], expected, atol=1e-5, rtol=1e-5)
        row += qlen
    assert cache[:, 0].abs().sum() == 0  # the null block is never written


def test_all_decode_batch_uses_one_call_and_matches() -> None:
    torch.manual_seed(3)
    heads, kv_heads, dim = 6, 3, 16
    backend = TorchPagedAttention(torch.device("cpu"), torch.float32)
    cache = torch.zeros(backend.kv_cache_shape(NUM_BLOCKS, BLOCK, kv_heads, dim))
    seqs = [(5, [3, 9]), (11, [10, 2, 14]), (0, [20]), (7, [21, 22])]
    ks = [torch.randn(s + 1, kv_heads, dim) for s, _ in seqs]
    vs = [torch.randn(s + 1, kv_heads, dim) for s, _ in seqs]
    for (start, table), k, v in zip(seqs, ks, vs, strict=True):
        for p in range(start):
            cache[0, table[p // BLOCK], p % BLOCK] = k[p]
            cache[1, table[p // BLOCK], p % BLOCK] = v[p]
    _, _, layout = layout_for([([0], s, t) for s, t in seqs], BLOCK)
    md = backend.build_metadata(layout)
    assert isinstance(md, TorchAttentionMetadata)
    assert md.decode_rows == slice(0, 4) and not md.prefills
    assert md.decode_block_tables.tolist() == [[3, 9, 0], [10, 2, 14], [20, 0, 0], [21, 22, 0]]
    q = torch.randn(4, heads, dim)
    out = backend.forward(
        0, q, torch.stack([k[-1] for k in ks]), torch.stack([v[-1] for v in vs]), cache, md
    )
    for i, ((start, _), k, v) in enumerate(zip(seqs, ks, vs, strict=True)):
        torch.testing.assert_close(out[i : i + 1], naive(q[i : i + 1], k, v, start))


def test_copy_blocks_copies_every_layer() -> None:
    backend = TorchPagedAttention(torch.device("cpu"), torch.float32)
    layers = 3
    cache = torch.randn(layers, *backend.kv_cache_shape(8, BLOCK, 2, 4))
    before = cache.clone()
    backend.copy_blocks(cache, [(2, 5), (3, 6)])
    torch.testing.assert_close(cache[:, :, 5], before[:, :, 2])
    torch.testing.assert_close(cache[:, :, 6], before[:, :, 3])
    torch.testing.assert_close(cache[:, :, :5], before[:, :, :5])
    backend.copy_blocks(cache, [])  # nothing to do
