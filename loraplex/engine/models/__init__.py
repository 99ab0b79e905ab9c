"""Decoder models in loraplex's own torch code, with Hugging Face module names."""

from __future__ import annotations

from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

# Hugging Face ``architectures`` entry -> our implementation
ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

__all__ = ["ARCHITECTURES", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
