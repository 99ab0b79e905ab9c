"""Tiny random models wrapped by PEFT, for the adapter loader's tests and the real-engine API
tests: ``hf_config(arch)`` is the model's configuration, ``make_peft`` saves the adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

COMMON: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def hf_config(arch: str) -> PretrainedConfig:
    if arch == "qwen3":
        # head_dim != hidden / heads
        return Qwen3Config(**COMMON, head_dim=32, architectures=["Qwen3ForCausalLM"])
    return LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"])


def make_peft(out: Path, arch: str = "llama", seed: int = 0, **lora: Any) -> PeftModel:
    """A tiny random model wrapped by PEFT with non-zero LoRA weights, saved to ``out``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    peft_model.save_pretrained(str(out))
    return peft_model
