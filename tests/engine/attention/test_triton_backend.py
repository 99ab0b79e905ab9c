"""TritonPagedAttention (kernels interpreted on the CPU) against TorchPagedAttention on one step,
and ``LLM(attention_backend="triton")`` against the torch backend, greedy, on tiny Llama and Qwen3
models through chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from loraplex import SamplingParams
from loraplex.engine.attention.base import BatchLayout
from loraplex.engine.attention.select import select_backend
from loraplex.engine.attention.torch_backend import TorchPagedAttention
from loraplex.engine.attention.triton_backend import (
    TritonAttentionMetadata,
    TritonPagedAttention,
    split_segments,
)
from loraplex.llm import LLM
from tests.utils.models import make_tiny_model

triton = pytest.importorskip("triton")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def random_step(
    seqs: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, bs: int, seed: int
) -> tuple[BatchLayout, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layout, cache, q, k, v): earlier keys in the cache at shuffled blocks; q/k strided views."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    starts = np.array([s for s, _ in seqs], dtype=np.int64)
    qlens = np.array([n for _, n in seqs], dtype=np.int64)
    need = (starts + qlens + bs - 1) // bs
    num_blocks = int(need.sum()) + 3
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seqs), int(need.max()) + 1), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(need)])
    for i in range(len(seqs)):
        tables[i, : need[i]] = ids[offsets[i] : offsets[i + 1]]
    req = np.repeat(np.arange(len(seqs)), qlens)
    pos = np.arange(int(qlens.sum())) - (np.cumsum(qlens) - qlens)[req] + starts[req]
    slots = tables[req, pos // bs] * bs + pos % bs
    layout = BatchLayout(qlens, starts, tables, torch.from_numpy(slots), bs)
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen)
    cache[:, 0] = 0.0
    qk = torch.randn(len(pos), heads + kv_heads, dim, generator=gen)
    v = torch.randn(len(pos), kv_heads, dim, generator=gen)
    return layout, cache, qk[:, :heads], qk[:, heads:], v


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 1, 16), (2, 2, 32), (4, 2, 64)])
@pytest.mark.parametrize("num_segments", [None, 3])
def test_one_step_matches_the_torch_backend(
    heads: int, kv_heads: int, dim: int, num_segments: int | None
) -> None:
    bs = 4
    seqs = [(5, 1), (0, 6), (2 * bs - 1, 1), (0, 1), (bs + 2, 5), (3 * bs - 1, 1)]
    layout, cache, q, k, v = random_step(seqs, heads, kv_heads, dim, bs, seed=heads + dim)
    ref, ours = (
        TorchPagedAttention(CPU, torch.float32),
        TritonPagedAttention(CPU, torch.float32, kv_heads, num_segments),
    )
    md = ours.build_metadata(layout)
    assert isinstance(md, TritonAttentionMetadata)
    assert md.query_start_loc.tolist() == [0, 1, 7, 8, 9, 14, 15]
    assert md.seq_lens.tolist() == [6, 6, 2 * bs, 1, bs + 7, 3 * bs]
    assert md.block_tables.dtype == torch.int32 and md.max_query_len == 6
    ref_cache, our_cache = cache.clone(), cache.clone()
    expected = ref.forward(0, q, k, v, ref_cache, ref.build_metadata(layout))
    got = ours.forward(0, q, k, v, our_cache, md)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(our_cache, ref_cache)
    assert our_cache[:, 0].abs().sum() == 0  # the null block stays zero


def test_split_segments_only_for_small_long_decode_batches() -> None:
    assert split_segments(4, 2, 1, 8192, None) == 1  # off CUDA
    assert split_segments(4, 2, 7, 8192, 132) == 1  # a prefill chunk in the step
    assert split_segments(4, 2, 1, 300, 132) == 1  # short contexts
    assert split_segments(256, 8, 1, 8192, 132) == 1  # enough programs to fill the GPU
    assert split_segments(4, 2, 1, 8192, 132) == 16
    assert split_segments(2, 8, 1, 1500, 132) == 2


def test_selector_gives_triton_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(select_backend("triton", CPU, torch.float32, 4, 2)) is TritonPagedAttention
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"'triton' cannot serve this model: .*CUDA"):
        select_backend("triton", CPU, torch.float32, 4, 2)
    assert not isinstance(select_backend("auto", CPU, torch.float32), TritonPagedAttention)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


SCENARIOS = {
    "chunked": dict(max_num_batched_tokens=7, block_size=4, enable_prefix_caching=False),
    "prefix": dict(max_num_batched_tokens=64, block_size=4),
    "preempt": dict(num_blocks=14, block_size=4, max_num_batched_tokens=32, max_model_len=40),
}


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", dict(num_key_value_heads=1, num_attention_heads=4)),
        ("qwen3", dict(num_key_value_heads=2, head_dim=16)),
    ],
)
def test_llm_greedy_matches_the_torch_backend(
    tmp_path: Path, arch: str, overrides: dict[str, object]
) -> None:
    model_dir = make_tiny_model(
        tmp_path / arch, arch, seed=7, hidden_size=32, intermediate_size=64, **overrides
    )
    rng = random.Random(3)
    prefix = [rng.randrange(3, 500) for _ in range(9)]
    prompts = [
        (prefix if i % 2 else []) + [rng.randrange(3, 500) for _ in range(i + 2)] for i in range(6)
    ]
    max_tokens = [rng.randint(3, 8) for _ in prompts]
    for name, scenario in SCENARIOS.items():
        kwargs = {"dtype": "float32", "max_model_len": 64, **scenario}
        ref = greedy(LLM(model_dir, attention_backend="torch", **kwargs), prompts, max_tokens)  # type: ignore[arg-type]
        llm = LLM(model_dir, attention_backend="triton", **kwargs)  # type: ignore[arg-type]
        assert greedy(llm, prompts, max_tokens) == ref, name
        stats = llm.engine_stats()
        if name == "prefix":
            assert stats.prefix_cache_hits >= 2 * 8, stats  # 2 full blocks of the 9-token prefix
        if name == "preempt":
            assert stats.num_preemptions > 0, stats
        if name == "chunked":
            assert stats.num_steps > sum(map(len, prompts)) // 7
