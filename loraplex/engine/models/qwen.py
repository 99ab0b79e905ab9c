"""Qwen2 (bias on q/k/v) and Qwen3 (q/k RMSNorm over head_dim, explicit head_dim) decoders."""

from __future__ import annotations

from typing import Any

from loraplex.engine.models.llama import DecoderOptions, LlamaForCausalLM


def _refuse_sliding_window(cfg: Any) -> None:
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, cfg: Any) -> DecoderOptions:
        _refuse_sliding_window(cfg)
        return DecoderOptions(qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, cfg: Any) -> DecoderOptions:
        _refuse_sliding_window(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
