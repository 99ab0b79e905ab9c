"""NativePagedAttention (the C decode kernel) against TorchPagedAttention on hand-built paged
caches (how the backend is chosen: test_select.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from loraplex.engine.attention.base import BatchLayout
from loraplex.engine.attention.native import NativeAttentionMetadata, NativePagedAttention
from loraplex.engine.attention.torch_backend import TorchAttentionMetadata, TorchPagedAttention
from loraplex.kernels import native
from tests.utils.native_spy import LibSpy, install_spy

# On CI the compiler is part of the image: a missing library fails test_native_backend_is_chosen.
if native.library() is None and not os.environ.get("CI"):
    pytest.skip("native CPU kernels unavailable (no C compiler)", allow_module_level=True)

CPU = torch.device("cpu")
TOL = dict(atol=1e-5, rtol=1e-5)


class DecodeSpy:
    """Counts the decode kernel's calls through the shared library recorder."""

    def __init__(self, spy: LibSpy) -> None:
        self._spy = spy

    @property
    def calls(self) -> int:
        return self._spy.calls.count("lp_paged_decode_attention")


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> DecodeSpy:
    return DecodeSpy(install_spy(monkeypatch))


@dataclass
class Step:
    layout: BatchLayout
    cache: torch.Tensor  # [2, num_blocks, block_size, H_kv, Dh], block 0 (null) zeroed
    q: torch.Tensor  # [T, H, Dh] the first H heads of a [T, H + H_kv, Dh] tensor (strided)
    k: torch.Tensor  # [T, H_kv, Dh] the last H_kv heads of the same tensor
    v: torch.Tensor  # [T, H_kv, Dh]


def make_step(
    seqs: list[tuple[int, int]],  # (start position, query length) per request, in batch order
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int,
) -> Step:
    """A random step: every request's earlier keys already in the cache, its blocks shuffled ids.

    Block arithmetic (block_size 4, start 6, query length 3; table [17, 3, 9]):

        position  0 1 2 3 | 4 5 6 7 | 8
        block     17      | 3       | 9        slot = table[p // 4] * 4 + p % 4
                  cached ------>|new ------->
    """
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    starts = np.array([s for s, _ in seqs], dtype=np.int64)
    qlens = np.array([n for _, n in seqs], dtype=np.int64)
    need = (starts + qlens + block_size - 1) // block_size  # [B] blocks per request
    num_blocks = int(need.sum()) + 5  # block 0 is null, a few never used
    ids = rng.permutation(np.arange(1, num_blocks))
    width = int(need.max()) + 1  # one padding column (null block) for every request
    tables = np.zeros((len(seqs), width), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(need)])
    for i in range(len(seqs)):
        tables[i, : need[i]] = ids[offsets[i] : offsets[i + 1]]
    num_tokens = int(qlens.sum())
    req = np.repeat(np.arange(len(seqs)), qlens)  # [T] request of every row
    pos = np.arange(num_tokens) - (np.cumsum(qlens) - qlens)[req] + starts[req]  # [T]
    slots = tables[req, pos // block_size] * block_size + pos % block_size
    layout = BatchLayout(qlens, starts, tables, torch.from_numpy(slots), block_size)

    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    cache[:, 0] = 0.0
    qk = torch.randn(num_tokens, heads + kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    return Step(layout, cache, qk[:, :heads], qk[:, heads:], v)


def run_both(step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(torch out, native out, torch cache after, native cache after)."""
    ref, nat = TorchPagedAttention(CPU, torch.float32), NativePagedAttention(CPU, torch.float32)
    ref_cache, nat_cache = step.cache.clone(), step.cache.clone()
    ref_out = ref.forward(0, step.q, step.k, step.v, ref_cache, ref.build_metadata(step.layout))
    nat_out = nat.forward(0, step.q, step.k, step.v, nat_cache, nat.build_metadata(step.layout))
    return ref_out, nat_out, ref_cache, nat_cache


# GQA (group 3), MHA, a head_dim off the vector width, and head_dims of 1, 3 and 8 AVX-512 vectors
HEADS = [(9, 3, 64), (4, 4, 32), (6, 2, 20), (8, 2, 128), (2, 2, 16), (4, 2, 48)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("block_size", [16, 8, 1, 48])
def test_mixed_batch_matches_torch(
    spy: DecodeSpy, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    bs = block_size
    seqs = [
        (5, 1),  # decode
        (0, 13),  # first prefill chunk
        (2 * bs - 1, 1),  # decode whose length is a multiple of the block size
        (0, 1),  # decode of length 1 (a one-token prompt)
        (20, 6),  # later prefill chunk
        (37, 1),  # decode
        (bs, 3),  # later chunk starting on a block boundary
        (3 * bs - 1, 1),  # decode, exact multiple again, last row of the batch
    ]
    step = make_step(seqs, heads, kv_heads, head_dim, bs, seed=heads * 100 + bs)
    assert not step.q.is_contiguous() and step.q.stride(0) == (heads + kv_heads) * head_dim
    md = NativePagedAttention(CPU, torch.float32).build_metadata(step.layout)
    assert md.decode_rows_host.tolist() == [0, 14, 15, 22, 26]  # not a run of the flat batch
    assert md.decode_seq_lens_host.tolist() == [6, 2 * bs, 1, 38, 3 * bs]
    assert len(md.prefills) == 3
    assert sorted(p.start_pos for p in md.prefills) == sorted([0, bs, 20])

    ref_out, nat_out, ref_cache, nat_cache = run_both(step)

    assert spy.calls == 1
    torch.testing.assert_close(nat_out, ref_out, **TOL)
    assert torch.equal(nat_cache, ref_cache)
    assert not torch.equal(nat_cache, step.cache)  # this step's keys were written
    assert nat_cache[:, 0].abs().sum() == 0  # the null block stays zero


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("block_size", [16, 1])
def test_all_decode_batch_matches_torch(
    spy: DecodeSpy, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    rng = np.random.default_rng(block_size)
    starts = [0, block_size - 1, 4 * block_size - 1, *rng.integers(1, 90, 13).tolist()]
    step = make_step([(s, 1) for s in starts], heads, kv_heads, head_dim, block_size, seed=7)
    md = TorchPagedAttention(CPU, torch.float32).build_metadata(step.layout)
    assert isinstance(md, TorchAttentionMetadata) and md.decode_rows == slice(0, 16)

    ref_out, nat_out, ref_cache, nat_cache = run_both(step)

    assert spy.calls == 1
    torch.testing.assert_close(nat_out, ref_out, **TOL)
    assert torch.equal(nat_cache, ref_cache)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("block_size", [16, 1])
def test_bf16_cache_matches_torch_on_the_same_cache(
    spy: DecodeSpy, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """A bf16 KV cache beside fp32 activations: the kernel widens what it reads and sums in
    fp32, as the torch backend does on the widened cache; this step's k/v are rounded to bf16
    as they are written (the same bits in both), and the cache stays bf16."""
    bs = block_size
    seqs = [(5, 1), (0, 13), (2 * bs - 1, 1), (0, 1), (20, 6), (37, 1), (3 * bs - 1, 1)]
    step = make_step(seqs, heads, kv_heads, head_dim, bs, seed=heads * 10 + bs)
    step.cache = step.cache.to(torch.bfloat16)
    ref_out, nat_out, ref_cache, nat_cache = run_both(step)
    assert spy.calls == 1
    assert nat_cache.dtype == torch.bfloat16 and nat_out.dtype == torch.float32
    torch.testing.assert_close(nat_out, ref_out, **TOL)
    assert torch.equal(nat_cache, ref_cache)
    # what the cache holds is this step's k rounded to bf16 (not a cast of garbage bits)
    slot = int(step.layout.slot_mapping[0])
    stored = nat_cache[0].view(-1, kv_heads, head_dim)[slot]
    assert torch.equal(stored, step.k[0].to(torch.bfloat16))


def test_prefill_only_batch_skips_the_kernel(spy: DecodeSpy) -> None:
    step = make_step([(0, 9), (12, 4)], 9, 3, 64, 8, seed=3)
    ref_out, nat_out, ref_cache, nat_cache = run_both(step)
    assert spy.calls == 0
    torch.testing.assert_close(nat_out, ref_out, **TOL)
    assert torch.equal(nat_cache, ref_cache)


def test_contiguous_q_gives_the_same_result() -> None:
    step = make_step([(4, 1), (0, 5), (30, 1)], 9, 3, 64, 8, seed=11)
    backend = NativePagedAttention(CPU, torch.float32)
    strided = backend.forward(
        0, step.q, step.k, step.v, step.cache.clone(), backend.build_metadata(step.layout)
    )
    packed = backend.forward(
        0,
        step.q.contiguous(),
        step.k.contiguous(),
        step.v,
        step.cache.clone(),
        backend.build_metadata(step.layout),
    )
    assert torch.equal(strided, packed)


def test_seq_len_beyond_the_block_table_raises() -> None:
    bs = 4
    step = make_step([(5, 1), (3 * bs, 1)], 4, 4, 32, bs, seed=5)
    layout = step.layout
    # the second decode attends to 3 * bs + 1 keys, but its table only holds 3 blocks
    short = layout.block_tables[:, :3].copy()
    bad = BatchLayout(layout.query_lens, layout.start_positions, short, layout.slot_mapping, bs)
    backend = NativePagedAttention(CPU, torch.float32)
    md = backend.build_metadata(bad)
    assert isinstance(md, NativeAttentionMetadata) and md.decode_tables_host.shape == (2, 3)
    with pytest.raises(RuntimeError, match="lp_paged_decode_attention rejected"):
        backend.forward(0, step.q, step.k, step.v, step.cache.clone(), md)


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize(("heads", "kv_heads"), [(12, 6), (8, 4), (9, 3), (320, 64)])
@pytest.mark.parametrize("num_decodes", [1, 2, 3, 40])
def test_tasks_split_by_kv_heads_match_torch(
    monkeypatch: pytest.MonkeyPatch, threads: int, heads: int, kv_heads: int, num_decodes: int
) -> None:
    # Few sequences a thread: each task takes a divisor of the KV heads (6 -> 3, 2 or 1), many:
    # every KV head of a sequence; every split must give the same attention (320 heads: the
    # per-head state lives in the thread's scratch, not in fixed-size arrays).
    monkeypatch.setattr(native, "num_threads", lambda: threads)
    rng = np.random.default_rng(num_decodes)
    starts = rng.integers(1, 70, num_decodes).tolist()
    step = make_step([(s, 1) for s in starts], heads, kv_heads, 16, 16, seed=threads + heads)
    ref_out, nat_out, _, _ = run_both(step)
    torch.testing.assert_close(nat_out, ref_out, **TOL)


@pytest.mark.parametrize("block_size", [16, 5])
def test_large_scores_keep_the_softmax_exact(block_size: int) -> None:
    # Scores hundreds apart within a block: exp against anything but its true maximum overflows
    # (clamped), so the running max (vector lanes, then the tail) must be exact, not a bound.
    starts = [0, 7, 40, 95]
    step = make_step([(s, 1) for s in starts], 9, 3, 64, block_size, seed=13)
    step.cache[0] *= 100.0  # keys: scores q . k / sqrt(64) hundreds apart within a block
    ref_out, nat_out, _, _ = run_both(step)
    assert torch.isfinite(ref_out).all()
    torch.testing.assert_close(nat_out, ref_out, atol=1e-4, rtol=1e-4)
