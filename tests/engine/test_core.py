"""EngineCore.build: the one engine factory (the offline engine and both clients use it)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from loraplex.engine.core import EngineCore
from tests.utils.models import make_tiny_model


def test_build_describes_the_core_it_built(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=2)
    config = EngineConfig(
        model=ModelConfig(model=model_dir, max_model_len=96),
        cache=CacheConfig(block_size=8, num_blocks=40),
        lora=LoRAConfig(max_loras=2, max_cpu_loras=3, max_lora_rank=16),
    )
    core, info = EngineCore.build(config, model_dir, tokenizer=SimpleNamespace(eos_token_id=7))
    assert (info.model_dir, info.max_model_len, info.vocab_size) == (
        model_dir,
        core.max_model_len,
        core.vocab_size,
    )
    assert (info.block_size, info.num_blocks) == (8, 39)
    assert (info.max_loras, info.max_cpu_loras, info.max_lora_rank) == (2, 3, 16)
    assert info.lora_target_modules == core.lora_target_modules
    assert info.eos_token_ids == (2, 7)  # the model's, then the tokenizer's
    _, from_dir = EngineCore.build(config, model_dir)  # the tokenizer saved with the model
    assert 2 in from_dir.eos_token_ids
