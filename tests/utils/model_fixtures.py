"""Tiny random-weight Hugging Face models for the model, attention and runner tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from loraplex.engine.attention.base import BatchLayout
from loraplex.engine.attention.torch_backend import TorchPagedAttention
from loraplex.engine.models.llama import LlamaForCausalLM

COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    vocab_size=211,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.08,
)

CONFIGS: dict[str, PretrainedConfig] = {
    # GQA, untied
    "llama_gqa": LlamaConfig(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, **COMMON
    ),
    # MHA, tied, rope theta changed
    "llama_mha_tied": LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        rope_theta=500.0,
        **COMMON,
    ),
    "llama3_rope": LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        **COMMON,
    ),
    "mistral": MistralConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
        **COMMON,
    ),
    "qwen2": Qwen2Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        **COMMON,
    ),
    "qwen3": Qwen3Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=False,
        **COMMON,
    ),
}


def save_tiny(name: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """Save a random fp32 model of CONFIGS[name] to ``path``; return the HF reference model."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(
        CONFIGS[name], dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():  # non-trivial norms and biases so that a wrong load shows
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf.eval()


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [L, V]


def cache_for(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> torch.Tensor:
    """A zeroed cache bound to ``model``; ``[layers, 2, num_blocks, block_size, H_kv, Dh]``."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = torch.zeros(
        cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads, head_dim
    )
    model.bind_attention(
        TorchPagedAttention(torch.device("cpu"), torch.float32), list(cache.unbind(0))
    )
    return cache


def layout_for(
    chunks: list[tuple[list[int], int, list[int]]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, BatchLayout]:
    """Build a step by hand: ``chunks`` = [(token_ids, start_pos, block_table)] per request."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    width = max(len(bt) for _, _, bt in chunks)
    table = np.zeros((len(chunks), width), dtype=np.int64)
    for i, (toks, start, bt) in enumerate(chunks):
        table[i, : len(bt)] = bt
        for j, t in enumerate(toks):
            p = start + j
            ids.append(t)
            pos.append(p)
            slots.append(bt[p // block_size] * block_size + p % block_size)
    layout = BatchLayout(
        query_lens=np.array([len(c[0]) for c in chunks], dtype=np.int64),
        start_positions=np.array([c[1] for c in chunks], dtype=np.int64),
        block_tables=table,
        slot_mapping=torch.tensor(slots),
        block_size=block_size,
    )
    return torch.tensor(ids), torch.tensor(pos), layout


class GreedySampler:
    """Argmax sampler with the Sampler interface; records what it was asked."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.calls: list[tuple[torch.Tensor, list[str]]] = []
        self.forgotten: list[str] = []

    def __call__(
        self, logits: torch.Tensor, rows: list[Any], token_masks: Any = None
    ) -> tuple[list[int], list[None]]:
        assert token_masks is None, "GreedySampler applies no token masks"
        assert logits.dtype == torch.float32 and logits.shape == (len(rows), self.vocab_size)
        self.calls.append((logits.clone(), [r.request_id for r in rows]))
        return logits.argmax(-1).tolist(), [None] * len(rows)

    def forget(self, request_ids: list[str]) -> None:
        self.forgotten.extend(request_ids)
