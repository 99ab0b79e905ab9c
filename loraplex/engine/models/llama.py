"""Llama-family decoder (Llama, Mistral, SmolLM2; Qwen2/Qwen3 in ``qwen.py``) on flat batches.

Module names mirror Hugging Face's so checkpoints load by name; q/k/v and gate/up are fused into
``qkv_proj`` and ``gate_up_proj``, declared in ``packed_modules``; the linears LoRA wraps are
declared in ``lora_modules``. Forward takes the step's flat
``input_ids [T]`` and ``positions [T]`` plus the attention metadata and returns ``[T, hidden]``;
``compute_logits`` applies the LM head to the rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.attention.base import AttentionBackend, AttentionMetadata
from loraplex.engine.models.layers import (
    Linear,
    PackedLinear,
    RMSNorm,
    RopeBatch,
    RotaryEmbedding,
    rope_parameters,
)
from loraplex.engine.models.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    gather_logits,
    kv_heads_of,
    split,
)
from loraplex.kernels import cpu_ops, packed_gemm


@dataclass(frozen=True)
class DecoderOptions:
    """Per-architecture variations of the decoder layer."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before rope


class Embedding(nn.Module):
    """Token embeddings ``[num, dim]``.

    ``transposed``: stored ``[dim, num]`` and exposed as the usual ``[num, dim]`` view, as
    ``Linear`` stores its weight. For a tied LM head on the CPU this makes the logits a plain
    GEMM (faster at decode-sized batches: ``python -m benchmarks.gemm``) at the cost of a strided row gather for the
    lookup, which touches only the step's tokens.
    """

    def __init__(
        self,
        num: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        transposed: bool = False,
    ) -> None:
        super().__init__()
        shape = (dim, num) if transposed else (num, dim)
        data = torch.empty(shape, dtype=dtype, device=device)
        self.weight = nn.Parameter(data.t() if transposed else data, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)  # [T, dim]


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism)."""

    def __init__(
        self,
        cfg: Any,
        layer_idx: int,
        opts: DecoderOptions,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        heads: int = cfg.num_attention_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.num_heads = split(heads, tp, "number of attention heads")
        self.num_kv_heads, first_kv = kv_heads_of(cfg.num_key_value_heads or heads, tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        shards = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}
        self.qkv_proj: PackedLinear
        self.o_proj: Linear
        if tp.size == 1:
            self.qkv_proj = PackedLinear(cfg.hidden_size, shards, opts.qkv_bias, dtype, device)
            self.o_proj = Linear(self.q_size, cfg.hidden_size, opts.o_bias, dtype, device)
        else:
            kv_start = first_kv * self.head_dim
            starts = {"q_proj": tp.rank * self.q_size, "k_proj": kv_start, "v_proj": kv_start}
            self.qkv_proj = ColumnParallelLinear(
                cfg.hidden_size, shards, starts, opts.qkv_bias, dtype, device
            )
            self.o_proj = RowParallelLinear(
                self.q_size, cfg.hidden_size, opts.o_bias, dtype, device, tp
            )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if opts.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
        # Bound once by the runner (``bind_attention``), not per step.
        self.backend: AttentionBackend | None = None
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: RopeBatch,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.backend is None or self.kv_cache is None:
            raise RuntimeError("attention has no KV cache: call model.bind_attention() first")
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q + 2 * kv]
        heads = self.num_heads + self.num_kv_heads
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(t, heads, self.head_dim)  # [T, H + H_kv, Dh]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, H_kv, Dh]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)  # [T, H + H_kv, Dh]
        qk = rope.apply(qk)  # one rope call for q and k
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, Dh], [T, H_kv, Dh]
        out = self.backend.forward(self.layer_idx, q, k, v, self.kv_cache, metadata)  # [T, H, Dh]
        return self.o_proj(out.reshape(t, self.q_size))  # [T, hidden]


class MLP(nn.Module):
    """SwiGLU over this rank's share of the intermediate width."""

    def __init__(
        self,
        cfg: Any,
        opts: DecoderOptions,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        inter = split(int(cfg.intermediate_size), tp, "intermediate_size")
        self.intermediate_size = inter
        shards = {"gate_proj": inter, "up_proj": inter}
        self.gate_up_proj: PackedLinear
        self.down_proj: Linear
        if tp.size == 1:
            self.gate_up_proj = PackedLinear(cfg.hidden_size, shards, opts.mlp_bias, dtype, device)
            self.down_proj = Linear(inter, cfg.hidden_size, opts.mlp_bias, dtype, device)
        else:
            starts = {"gate_proj": tp.rank * inter, "up_proj": tp.rank * inter}
            self.gate_up_proj = ColumnParallelLinear(
                cfg.hidden_size, shards, starts, opts.mlp_bias, dtype, device
            )
            self.down_proj = RowParallelLinear(
                inter, cfg.hidden_size, opts.mlp_bias, dtype, device, tp
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * inter] = gate | up
        return self.down_proj(cpu_ops.silu_mul(gate_up, self.intermediate_size))  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: Any,
        layer_idx: int,
        opts: DecoderOptions,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, opts, dtype, device, tp)
        self.mlp = MLP(cfg, opts, dtype, device, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(
        self,
        residual: torch.Tensor,  # [T, hidden], updated in place
        delta: torch.Tensor | None,  # [T, hidden] the previous layer's MLP output, not yet added
        rope: RopeBatch,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] this layer's MLP output, for the next residual add
        """``residual += delta; residual += attn(norm(residual)); return mlp(norm(residual))``.

        The MLP output is returned unadded so that the next norm fuses the add (one pass).
        """
        if delta is None:
            x = self.input_layernorm(residual)
        else:
            x = self.input_layernorm.add_forward(delta, residual)
        attn = self.self_attn(x, rope, metadata)  # [T, hidden]
        x = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp(x)


class DecoderModel(nn.Module):
    def __init__(
        self,
        cfg: Any,
        opts: DecoderOptions,
        max_position: int,
        dtype: torch.dtype,
        device: torch.device,
        embed_transposed: bool = False,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.embed_tokens: Embedding | VocabParallelEmbedding
        if tp.size == 1:
            self.embed_tokens = Embedding(
                cfg.vocab_size, cfg.hidden_size, dtype, device, transposed=embed_transposed
            )
        else:
            self.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, dtype, device, tp, transposed=embed_transposed
            )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, opts, dtype, device, tp) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary_emb = RotaryEmbedding(
            head_dim, max_position, rope_parameters(cfg), dtype, device
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        rope = self.rotary_emb.batch(positions)  # once per step, shared by all layers
        residual = self.embed_tokens(input_ids)  # [T, hidden], a new tensor: updated in place
        delta: torch.Tensor | None = None
        for layer in self.layers:
            delta = layer(residual, delta, rope, metadata)
        if delta is None:
            return self.norm(residual)
        return self.norm.add_forward(delta, residual)  # [T, hidden]


class LlamaForCausalLM(nn.Module):
    """LlamaForCausalLM / MistralForCausalLM (tied or untied embeddings, llama3 rope scaling)."""

    # packed parameter -> the checkpoint projections stacked in it, in output order
    packed_modules: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # the decoder-layer linears LoRA wraps (attribute paths from a decoder layer)
    lora_modules: ClassVar[tuple[str, ...]] = (
        "self_attn.qkv_proj",
        "self_attn.o_proj",
        "mlp.gate_up_proj",
        "mlp.down_proj",
    )

    @classmethod
    def lora_targets(cls) -> dict[str, list[str]]:
        """Each of ``lora_modules`` -> the checkpoint modules it holds, in output order
        (``packed_modules`` for a packed one): together, the modules an adapter may target."""
        targets: dict[str, list[str]] = {}
        for path in cls.lora_modules:
            leaf = path.rpartition(".")[2]
            targets[path] = list(cls.packed_modules.get(leaf, [leaf]))
        return targets

    @classmethod
    def decoder_options(cls, cfg: Any) -> DecoderOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False))
        )

    def __init__(
        self,
        cfg: Any,
        max_position: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup = SINGLE,
    ) -> None:
        """``tp``: build this rank's share of every layer (``models/parallel.py``)."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.vocab_size = int(cfg.vocab_size)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.model = DecoderModel(
            cfg,
            self.decoder_options(cfg),
            max_position,
            dtype,
            device,
            # the tied head's logits as a plain GEMM on the CPU (see Embedding), unless the
            # packed kernel computes them: then rows stay contiguous for the lookup, which the
            # strided gather made a visible part of the base workload's wall time (same tokens;
            # python -m benchmarks.ab_trees --old REV compares)
            embed_transposed=self.tie_word_embeddings
            and device.type == "cpu"
            and not packed_gemm.packs(dtype, device),
            tp=tp,
        )
        self.lm_head: Linear | None = None
        self.tied_head_packed: torch.Tensor | None = None  # pack_weights(), tied head on CPU
        if not self.tie_word_embeddings:
            if tp.size == 1:
                self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
            else:
                self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, dtype, device, tp)

    def bind_attention(self, backend: AttentionBackend, kv_caches: list[torch.Tensor]) -> None:
        """Give every attention layer the backend and its own layer of the KV cache."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"need {len(self.model.layers)} KV cache layers, got {len(kv_caches)}")
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.backend = backend
            layer.self_attn.kv_cache = cache

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)  # [T, hidden]

    def pack_weights(self, dtype: torch.dtype = torch.float32) -> None:
        """After loading: panel-packed copies of every linear weight (values in ``dtype``:
        float32, or bfloat16 where the CPU has bf16 units) and of the tied head (float32: the
        logits keep fp32 weights), for the CPU GEMM (``packed_gemm``); a no-op elsewhere."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_weight(dtype)
        if self.lm_head is None:
            self.tied_head_packed = packed_gemm.pack(self.model.embed_tokens.weight.t())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S, hidden]`` (the sampling rows only) -> logits ``[S, vocab_size]`` (with
        tensor parallelism: on rank 0; every rank must call it, the logits are gathered)."""
        if self.lm_head is None:
            embed = self.model.embed_tokens.weight  # [vocab (this rank's rows), hidden]
            logits = packed_gemm.linear(hidden, embed, self.tied_head_packed)
        else:
            logits = self.lm_head(hidden)
        return gather_logits(logits, self.vocab_size, self.tp)  # [S, vocab_size]
