"""Shared fixtures: tiny random-weight Hugging Face models saved as real model directories."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_VOCAB = 512


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose vocabulary is exactly t0 .. t{vocab_size-1}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", eos_token="t2", bos_token="t1"
    )
    fast.save_pretrained(path)


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> str:
    """Save a random model of ``arch`` (llama | qwen2 | qwen3) in fp32 to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        config: Any = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "qwen3":
        common.setdefault("head_dim", 32)
        config = Qwen3Config(**common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is near zero; larger weights give peaked, seed-dependent distributions.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    _write_tokenizer(path, TINY_VOCAB)
    return str(path)


@pytest.fixture
def tiny_llama(tmp_path: Path) -> str:
    return make_tiny_model(tmp_path / "llama", "llama")
