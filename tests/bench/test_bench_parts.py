from __future__ import annotations

import pytest

from loraplex.bench.flops import ModelShape, workload_flops
from loraplex.bench.systems import greedy_agreement
from loraplex.bench.workload import make_workload


def test_workload_is_seeded_and_in_range() -> None:
    a = make_workload(50, 16, 128, seed=3)
    assert a == make_workload(50, 16, 128, seed=3)
    assert a != make_workload(50, 16, 128, seed=4)
    assert all(20 <= len(p.split()) <= 60 for p in a.prompts)
    assert all(16 <= n <= 128 for n in a.output_lens)
    assert len(set(a.prompts)) == 50


def test_workload_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError, match="min_output"):
        make_workload(4, 10, 5)


def test_flops_by_hand() -> None:
    shape = ModelShape(
        num_layers=2, hidden=8, intermediate=16, num_heads=2, num_kv_heads=1, head_dim=4, vocab=10
    )
    # per layer: q 8*8 + k,v 2*8*4 + o 8*8 + mlp 3*8*16 = 64 + 64 + 64 + 384 = 576
    assert shape.linear_params == 2 * 576
    f = workload_flops(shape, [3], [2])  # computes positions 0..3, samples 2 rows
    assert f["computed_tokens"] == 4 and f["sampled_rows"] == 2
    assert f["linear"] == 2 * 1152 * 4
    assert f["lm_head"] == 2 * 80 * 2
    assert f["attention"] == 4 * 2 * 2 * 4 * (1 + 2 + 3 + 4)


def test_decode_step_flops_match_torch_flop_counter() -> None:
    """One decode step is counted exactly as torch's FlopCounterMode counts the HF model."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt = 7
    with torch.inference_mode():
        out = model(torch.arange(prompt)[None], use_cache=True)
        counter = FlopCounterMode(display=False)
        with counter:
            model(torch.tensor([[5]]), cache=out.past_key_values, use_cache=True)
    shape = ModelShape.from_config(config.to_dict())
    step = (
        workload_flops(shape, [prompt], [2])["total"]
        - workload_flops(shape, [prompt], [1])["total"]
    )
    assert counter.get_total_flops() == step


def test_greedy_agreement() -> None:
    got = greedy_agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]])
    assert got["requests_compared"] == 2
    assert got["identical_fraction"] == 0.5
    assert got["prefix_match_fraction"] == pytest.approx(4 / 5)
