"""Our models against Hugging Face's on tiny random checkpoints, and strict loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.attention.base import SplitAttentionMetadata
from loraplex.engine.models.layers import Linear, PackedLinear, rope_inv_freq, rope_parameters
from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.models.loader import build_spec, load_model
from loraplex.kernels import packed_gemm
from tests.utils.model_fixtures import CONFIGS, cache_for, hf_logits, layout_for, save_tiny

BLOCK = 4


def our_logits(model: LlamaForCausalLM, ids: list[int], table: list[int]) -> torch.Tensor:
    """All-position logits of one sequence computed in one prefill through the paged path."""
    cache_for(model, num_blocks=32, block_size=BLOCK)
    input_ids, positions, layout = layout_for([(ids, 0, table)], BLOCK)
    backend = model.model.layers[0].self_attn.backend  # type: ignore[union-attr]
    assert backend is not None
    metadata = backend.build_metadata(layout)
    assert isinstance(metadata, SplitAttentionMetadata)  # torch or native backend
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, metadata))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_full_sequence_logits_match_hf(name: str, seed: int, tmp_path: Path) -> None:
    hf = save_tiny(name, tmp_path, seed=seed)
    model, _ = load_model(str(tmp_path))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIGS[name].vocab_size, (45,), generator=gen).tolist()
    table = [9, 3, 17, 1, 30, 2, 8, 11, 4, 5, 6, 7]  # non-contiguous, covers 48 positions
    torch.testing.assert_close(
        our_logits(model, ids, table), hf_logits(hf, ids), atol=1e-4, rtol=1e-4
    )


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf = save_tiny("llama_gqa", tmp_path / "ref")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    model, _ = load_model(str(tmp_path / "sharded"))
    ids = list(range(3, 30))
    torch.testing.assert_close(
        our_logits(model, ids, list(range(1, 9))), hf_logits(hf, ids), atol=1e-4, rtol=1e-4
    )


def test_packed_slices_and_names(tmp_path: Path) -> None:
    save_tiny("qwen3", tmp_path)
    model, _ = load_model(str(tmp_path))
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, PackedLinear)
    # 4 heads and 2 kv heads of head_dim 24
    assert attn.qkv_proj.output_slices == {
        "q_proj": (0, 96),
        "k_proj": (96, 48),
        "v_proj": (144, 48),
    }
    assert model.model.layers[1].mlp.gate_up_proj.output_slices == {
        "gate_proj": (0, 128),
        "up_proj": (128, 128),
    }
    names = dict(model.named_parameters())
    assert "model.layers.1.self_attn.q_norm.weight" in names
    assert "lm_head.weight" in names
    # the loaded slice is the checkpoint's k_proj
    ckpt = load_file(str(tmp_path / "model.safetensors"))
    torch.testing.assert_close(
        attn.qkv_proj.weight[96:144], ckpt["model.layers.0.self_attn.k_proj.weight"]
    )


def _rewrite(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_weight_is_one_clear_error(tmp_path: Path) -> None:
    save_tiny("llama_gqa", tmp_path)
    _rewrite(tmp_path, {"model.layers.1.self_attn.v_proj.weight": None})
    with pytest.raises(
        ValueError,
        match=r"missing weights: model\.layers\.1\.self_attn\.qkv_proj\.weight\[v_proj\]",
    ):
        load_model(str(tmp_path))


def test_unexpected_weight_is_one_clear_error(tmp_path: Path) -> None:
    save_tiny("llama_gqa", tmp_path)
    _rewrite(tmp_path, {"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(
        ValueError, match=r"unexpected weights: model\.layers\.0\.mlp\.extra_proj\.weight"
    ):
        load_model(str(tmp_path))


def test_shape_mismatch_names_the_weight(tmp_path: Path) -> None:
    save_tiny("llama_gqa", tmp_path)
    _rewrite(tmp_path, {"model.norm.weight": torch.ones(7)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape mismatch"):
        load_model(str(tmp_path))


def test_ignored_buffers_and_tied_head(tmp_path: Path) -> None:
    save_tiny("llama_mha_tied", tmp_path)
    _rewrite(
        tmp_path,
        {
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
            "lm_head.weight": torch.zeros(211, 64),  # tied: the embedding is the head
        },
    )
    model, _ = load_model(str(tmp_path))
    assert model.lm_head is None


def test_unknown_architecture(tmp_path: Path) -> None:
    save_tiny("llama_gqa", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"unsupported model architecture.*supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        load_model(str(tmp_path))


def test_not_a_model_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(str(tmp_path))


def test_llama3_rope_matches_hf(tmp_path: Path) -> None:
    hf = save_tiny("llama3_rope", tmp_path)
    cfg = CONFIGS["llama3_rope"]
    ours = rope_inv_freq(16, rope_parameters(cfg), cfg.max_position_embeddings)
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq.float())
    assert not torch.allclose(
        ours, rope_inv_freq(16, {"rope_theta": 10000.0, "rope_type": "default"}, 256)
    )
    # and end to end beyond original_max_position_embeddings (32)
    model, _ = load_model(str(tmp_path))
    ids = list(range(5, 75))
    torch.testing.assert_close(
        our_logits(model, ids, list(range(1, 19))), hf_logits(hf, ids), atol=1e-4, rtol=1e-4
    )


def test_old_style_rope_config() -> None:
    class Old:  # transformers 4 layout: rope_theta on top, rope_scaling dict
        def __init__(self) -> None:
            self.rope_theta = 1234.0
            self.rope_scaling = {
                "type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }

    params = rope_parameters(Old())
    assert params["rope_theta"] == 1234.0 and params["rope_type"] == "llama3"


def test_dtype_and_spec(tmp_path: Path) -> None:
    save_tiny("qwen3", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3]}))
    model, hf_config = load_model(str(tmp_path), dtype="bfloat16")
    if packed_gemm.bf16_supported():  # bf16 matrix products, fp32 activations
        assert model.model.embed_tokens.weight.dtype == torch.float32
        linear = next(m for m in model.modules() if isinstance(m, Linear))
        assert linear.packed is not None and linear.packed.dtype == torch.bfloat16
    else:  # a torch bf16 model
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    model32, _ = load_model(str(tmp_path), dtype="auto", device="cpu")
    assert model32.model.norm.weight.dtype == torch.float32
    spec = build_spec(str(tmp_path), hf_config, torch.float32)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (2, 2, 24, 211)
    assert spec.eos_token_ids[:2] == (7, 3)
    assert spec.max_position_embeddings == 256
    assert spec.kv_bytes_per_block(16) == 2 * 2 * 16 * 2 * 24 * 4
