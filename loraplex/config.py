"""Frozen, validated configuration records for every engine knob.

Each record validates itself once in ``__post_init__`` and raises ``ValueError`` with a message a
user understands. Nothing mutates a config after construction; derived values are computed by the
engine and kept beside the config, not written into it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

DType = Literal["auto", "float32", "float16", "bfloat16"]
# KV cache storage: auto is the activations' dtype (engine/models/precision.py)
KVCacheDType = Literal["auto", "float32", "bfloat16"]
# The order waiting requests are admitted in (engine/waiting_queue.py): first come first served;
# lower priority first; or fair shares between tenants (Virtual Token Counter), priority first.
SchedulingPolicy = Literal["fcfs", "priority", "fair"]
AttentionBackendName = Literal["auto", "torch", "native", "triton"]  # engine/attention/select.py
# Request priorities (lower runs earlier, 0 the default): what an API caller may send.
PRIORITY_RANGE = (-1000, 1000)
# A tenant's share weight under the fair policy (1 = an equal share), both ends included: a
# request's charge is divided by its weight, so the bounds keep every fair counter finite and
# within a factor of 100 of an equal share's (a weight of 5e-324 made a counter +inf, for good).
TENANT_WEIGHT_RANGE = (0.01, 100.0)


MAX_LORAS = 256  # adapters one step may use: the page index is [modules, MAX_LORAS, rank]
MAX_LORA_RANK = 1024  # the native kernel's per-token buffer bound


@dataclass(frozen=True)
class ModelConfig:
    """Which base model to serve and how to run it."""

    model: str | None = None  # a local Hugging Face directory (or hub id); None = embedded SmolLM2
    dtype: DType = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    # auto: the native CPU kernel where it runs (CPU, float32, built), else torch
    attention_backend: AttentionBackendName = "auto"
    # never capture CUDA graphs; capture happens only on CUDA with attention_backend=triton
    enforce_eager: bool = False
    # ranks that share every layer (engine/tensor_parallel.py): gloo on CPU, NCCL on CUDA
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be one of auto, float32, float16, bfloat16; got {self.dtype!r}"
            )
        if self.attention_backend not in get_args(AttentionBackendName):
            raise ValueError(
                "attention_backend must be one of auto, torch, native, triton; "
                f"got {self.attention_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2; got {self.max_model_len}")
        tp = self.tensor_parallel_size
        if not _is_int(tp) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer of at least 1; got {tp!r}")
        if tp > 1 and self.attention_backend == "triton":
            raise ValueError(
                "attention_backend 'triton' is not supported with tensor_parallel_size > 1 "
                "(untested); use auto, torch or native"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing. At most one of num_blocks / kv_cache_memory may be given."""

    block_size: int = 16
    num_blocks: int | None = None  # total blocks including the reserved null block
    kv_cache_memory: int | None = None  # bytes for the KV cache (all layers)
    gpu_memory_utilization: float = 0.9  # CUDA only: fraction of device memory to use
    enable_prefix_caching: bool = True
    kv_cache_dtype: KVCacheDType = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"kv_cache_dtype must be auto, float32 or bfloat16; got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be between 1 and 1024; got {self.block_size}")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give either num_blocks or kv_cache_memory, not both")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is the reserved null block); "
                f"got {self.num_blocks}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(
                f"kv_cache_memory must be a positive byte count; got {self.kv_cache_memory}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = 64  # requests in one step
    # tokens in one step (prefill chunks + decodes). 1024: on 2 CPU cores the 64-request workload
    # ran faster than with 512 (prefill GEMMs of 1024 rows reach more of the sgemm peak, and
    # fewer steps); 2048 gave little more, with prefill steps (which the decodes beside them
    # wait for) twice as long again (``loraplex bench throughput --skip-hf
    # --max-num-batched-tokens N`` for N in 512, 1024, 2048). vLLM's own CPU defaults are 4096
    # (LLM) and 2048 (server).
    max_num_batched_tokens: int = 1024
    scheduling_policy: SchedulingPolicy = "fcfs"  # engine/waiting_queue.py
    # "fair": the service a tenant is charged per prompt token computed and per token generated
    # (S-LoRA's VTC prices; a generated token costs more: one forward each, and it holds KV)
    fair_prompt_weight: float = 1.0
    fair_output_weight: float = 2.0

    def __post_init__(self) -> None:
        policies = get_args(SchedulingPolicy)
        if self.scheduling_policy not in policies:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(policies)}; "
                f"got {self.scheduling_policy!r}"
            )
        for name in ("fair_prompt_weight", "fair_output_weight"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number of 0 or more; got {value!r}")
        if self.fair_prompt_weight == 0 and self.fair_output_weight == 0:
            raise ValueError(
                "fair_prompt_weight and fair_output_weight are both 0, so no service would be "
                "counted; make at least one of them positive"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1; got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA limits: adapters per step, the device pool's size, host cache entries and the
    largest rank accepted.

    ``lora_memory`` sizes the device page pool: bytes (an int), or a fraction of the KV cache's
    bytes (a float in (0, 1]); None: room for ``max_loras`` adapters at ``max_lora_rank``. Every
    adapter takes exactly its rank's pages, so a pool that holds 4 rank-64 adapters holds 32 of
    rank 8. ``lora_dtype`` is the pool's storage type (``auto``: the model's); kernels compute in
    the activations' type, so a float16 or bfloat16 pool under an fp32 model halves the bytes a
    step reads for its adapters at a rounding of the adapter weights (float16: 11 bits).
    """

    max_loras: int = 4
    max_cpu_loras: int = 16
    max_lora_rank: int = 64
    lora_memory: int | float | None = None
    lora_dtype: DType = "auto"

    def __post_init__(self) -> None:
        if not 1 <= self.max_loras <= MAX_LORAS:
            raise ValueError(f"max_loras must be in [1, {MAX_LORAS}]; got {self.max_loras}")
        if self.max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be at least 1; got {self.max_cpu_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(
                f"max_lora_rank must be in [1, {MAX_LORA_RANK}]; got {self.max_lora_rank}"
            )
        mem = self.lora_memory
        if isinstance(mem, bool) or not (mem is None or isinstance(mem, (int, float))):
            raise ValueError(f"lora_memory must be bytes, a fraction or None; got {mem!r}")
        if isinstance(mem, float) and not 0.0 < mem <= 1.0:
            raise ValueError(
                f"lora_memory as a fraction of the KV cache must be in (0, 1]; got {mem}"
            )
        if isinstance(mem, int) and mem < 1:
            raise ValueError(f"lora_memory must be a positive number of bytes; got {mem}")
        if self.lora_dtype not in get_args(DType):
            raise ValueError(
                f"lora_dtype must be one of {', '.join(get_args(DType))}; got {self.lora_dtype!r}"
            )


# Where draft tokens come from (engine/spec/): prompt lookup over the request's own tokens, or a
# smaller model with the same vocabulary.
SpeculativeMethod = Literal["ngram", "draft_model"]
MAX_SPECULATIVE_TOKENS = 16  # more is never worth a verification row on any device we target


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): ``num_speculative_tokens`` drafts
    per decoding request and step, verified by the target model in the same forward pass.

    ``ngram``: prompt lookup, the longest suffix of ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens found earlier in the request's prompt and output (defaults 2
    and 4). ``draft_model``: ``model``, a smaller model directory with the same vocabulary, run
    greedily without adapters on its own small KV cache.

    ``disable_by_batch_size``: no request speculates in a step where more requests than this
    are decoding (the step is compute-bound: draft rows cost as much as real ones). None: the
    device's default (``engine/spec/policy.py``). ``adaptive``: each request's draft length
    follows its own acceptance rate (off for a while when nothing gets accepted).
    """

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        methods = get_args(SpeculativeMethod)
        if self.method not in methods:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(methods)}; "
                f"got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an integer from 1 to "
                f"{MAX_SPECULATIVE_TOKENS}; got {k!r}"
            )
        for name in ("prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(
                    f"speculative_config.{name} must be an integer of at least 1; got {value!r}"
                )
        if not isinstance(self.adaptive, bool):
            raise ValueError(
                f"speculative_config.adaptive must be true or false; got {self.adaptive!r}"
            )
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError(
                    "speculative_config.model is for method 'draft_model'; method 'ngram' "
                    "drafts from the request's own tokens (drop 'model', or use 'draft_model')"
                )
            if self.lookup_min > self.lookup_max:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min ({self.lookup_min}) must not exceed "
                    f"prompt_lookup_max ({self.lookup_max})"
                )
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(
                    "speculative_config method 'draft_model' needs 'model': the directory of a "
                    "smaller model with the same vocabulary as the served one"
                )
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError(
                    "speculative_config.prompt_lookup_min/max are for method 'ngram'; drop "
                    "them for 'draft_model'"
                )

    @property
    def lookup_max(self) -> int:
        """The longest suffix prompt lookup tries (ngram)."""
        if self.prompt_lookup_max is not None:
            return self.prompt_lookup_max
        return max(4, self.prompt_lookup_min or 0)

    @property
    def lookup_min(self) -> int:
        """The shortest suffix prompt lookup accepts (ngram)."""
        if self.prompt_lookup_min is not None:
            return self.prompt_lookup_min
        return min(2, self.lookup_max)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM's dict form, e.g. ``{"method": "ngram", "num_speculative_tokens": 4}``;
        ``ValueError`` naming an unknown or missing key."""
        if not isinstance(data, Mapping):
            raise ValueError(
                f"speculative_config must be a JSON object / dict; got {type(data).__name__}"
            )
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(map(str, unknown))}; the keys "
                f"are {', '.join(known)}"
            )
        missing = [k for k in ("method", "num_speculative_tokens") if k not in data]
        if missing:
            raise ValueError(
                f"speculative_config needs {' and '.join(missing)}, e.g. "
                '{"method": "ngram", "num_speculative_tokens": 4}'
            )
        return cls(**data)


def speculative_config_of(value: object) -> SpeculativeConfig | None:
    """A ``SpeculativeConfig`` from what a caller may pass: one, a dict, or None (off)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, Mapping):
        return SpeculativeConfig.from_dict(value)
    raise ValueError(
        "speculative_config must be a dict such as "
        '{"method": "ngram", "num_speculative_tokens": 4}, a SpeculativeConfig, or None; '
        f"got {type(value).__name__}"
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    lora: LoRAConfig = LoRAConfig()
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            raise ValueError(
                "EngineConfig.speculative_config must be a SpeculativeConfig or None "
                "(engine_config() accepts a dict)"
            )
        if (
            self.model.tensor_parallel_size > 1
            and spec is not None
            and spec.method == "draft_model"
        ):
            raise ValueError(
                "speculative decoding with a draft model is not supported with "
                "tensor_parallel_size > 1; use method 'ngram' or tensor_parallel_size 1"
            )
