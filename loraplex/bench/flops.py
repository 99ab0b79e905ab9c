"""Exact matmul FLOP counts of a generation workload for a Llama-style decoder.

Convention (model FLOPs, as in MFU): one multiply-add = 2 FLOPs; norms, activations, rotary
embeddings and softmax are not counted. For one request with P prompt and O output tokens:

* linear layers (q, k, v, o, gate, up, down) run once per **computed token**: the P prompt
  tokens and the O - 1 generated tokens that are fed back (the last one never is): P + O - 1;
* lm_head runs only for the O **sampled rows** (the last prompt row, then each decode row);
  loraplex computes logits only for those rows, so that is exactly what it executes;
* attention: the token at position t attends causally to t + 1 keys, costing
  2·(t+1)·head_dim per head for QKᵀ and the same for PV, summed exactly over t = 0 .. P+O-2.

A LoRA adapter of rank r on all seven projections adds, per computed token, the shrink and expand
matmuls ``2·r·(in + out)`` of each projection (``lora_rank`` > 0); an engine padding slots to a
larger ``max_lora_rank`` executes more than this, which is not counted.

Prefix-cache reuse and preemption recompute are not counted (the workload's required work).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab=int(config["vocab_size"]),
        )

    @property
    def layer_matmul_params(self) -> int:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        return attn + 3 * self.hidden * self.intermediate

    @property
    def layer_lora_params_per_rank(self) -> int:
        """Sum of (in + out) over the seven projections of one layer: A and B params per rank."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = (self.hidden + q) + 2 * (self.hidden + kv) + (q + self.hidden)
        return attn + 3 * (self.hidden + self.intermediate)

    @property
    def linear_params(self) -> int:
        """Non-embedding matmul parameters of the decoder layers (lm_head counted apart)."""
        return self.num_layers * self.layer_matmul_params

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab

    def lora_bytes(self, rank: int, value_bytes: int) -> int:
        """One rank-``rank`` adapter on all seven projections of every layer: A and B."""
        return rank * self.num_layers * self.layer_lora_params_per_rank * value_bytes

    def decode_weight_bytes(self, value_bytes: int) -> int:
        """Base weights one decode step reads: every decoder matmul and lm_head (the embedding
        rows gathered and the norms are negligible)."""
        return (self.linear_params + self.lm_head_params) * value_bytes


def workload_flops(
    shape: ModelShape,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    *,
    lora_rank: int = 0,
) -> dict[str, int]:
    """FLOPs of generating ``output_lens[i]`` tokens after ``prompt_lens[i]`` prompt tokens
    (every request through a rank-``lora_rank`` adapter on all seven projections; 0: none)."""
    computed = sampled = attention_pairs = 0
    for p, o in zip(prompt_lens, output_lens, strict=True):
        n = p + o - 1  # positions 0 .. n-1 are computed
        computed += n
        sampled += o
        attention_pairs += n * (n + 1) // 2  # sum over t of (t + 1) keys
    linear = 2 * shape.linear_params * computed
    lm_head = 2 * shape.lm_head_params * sampled
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * attention_pairs
    lora = 2 * lora_rank * shape.num_layers * shape.layer_lora_params_per_rank * computed
    return {
        "computed_tokens": computed,
        "sampled_rows": sampled,
        "linear": linear,
        "lm_head": lm_head,
        "attention": attention,
        "lora": lora,
        "total": linear + lm_head + attention + lora,
    }
