"""The engine's knobs as keywords, command-line flags and environment variables: one table,
mapped to and from ``EngineConfig``, whose records hold every default (once).

    LLM(max_loras=8)                       engine_config(max_loras=8)
    loraplex serve --max-loras 8           add_engine_arguments(parser, env=True) + from_args
    LORAPLEX_MAX_LORAS=8 loraplex serve    (the environment gives a flag's default)
    loraplex bench throughput --max-loras  add_engine_arguments(parser, names=...)

A flag left unset maps to the config's own default, so no default is written here. Values are
validated by the config records (a ``ValueError`` that names the field).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, get_args

from loraplex.argtypes import (
    byte_size,
    env_bool,
    memory_size,
    non_negative_float,
    positive_float,
    positive_int,
)
from loraplex.config import (
    AttentionBackendName,
    CacheConfig,
    DType,
    EngineConfig,
    KVCacheDType,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    speculative_config_of,
)

ENV_PREFIX = "LORAPLEX_"
# "engine": a knob that is a field of ``EngineConfig`` itself (a whole record, e.g.
# speculative_config), not of one of its sections
Section = Literal["model", "cache", "scheduler", "lora", "engine"]
_RECORDS: dict[Section, type[Any]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "lora": LoRAConfig,
    "engine": EngineConfig,
}


def speculative_json(text: str) -> SpeculativeConfig:
    """``--speculative-config``: a JSON object (vLLM's), e.g.
    ``{"method": "ngram", "num_speculative_tokens": 4}``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as "
            f'\'{{"method": "ngram", "num_speculative_tokens": 4}}\'; {exc}'
        ) from None
    try:
        config = speculative_config_of(data)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if config is None:
        raise argparse.ArgumentTypeError("expected a JSON object, got null")
    return config


@dataclass(frozen=True)
class EngineArg:
    name: str  # the keyword, the config field, and the flag: --<name with dashes>
    section: Section
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    switch: bool = False  # --name / --no-name

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def default(self) -> Any:
        fields = {f.name: f for f in dataclasses.fields(_RECORDS[self.section])}
        return fields[self.name].default


ENGINE_ARGS: tuple[EngineArg, ...] = (
    EngineArg("dtype", "model", "weights and activations (auto: float32 on CPU, bf16 on CUDA)",
              choices=get_args(DType)),
    EngineArg("device", "model", "auto: cuda when available, else cpu"),
    EngineArg("max_model_len", "model", "context length (default: the model's)", positive_int),
    EngineArg("seed", "model", "the engine's random seed", int),
    EngineArg("attention_backend", "model", "auto: the native CPU kernel where it runs",
              choices=get_args(AttentionBackendName)),
    EngineArg("enforce_eager", "model",
              "no CUDA graphs (they capture decode steps on CUDA with the triton backend)",
              switch=True),
    EngineArg("tensor_parallel_size", "model",
              "ranks sharing every layer, one process each (gloo on CPU, NCCL on CUDA)",
              positive_int),
    EngineArg("block_size", "cache", "tokens per KV block", positive_int),
    EngineArg("num_blocks", "cache", "KV cache blocks (instead of --kv-cache-memory)",
              positive_int),
    EngineArg("kv_cache_memory", "cache", "KV cache size: bytes (150MB, 1.5GiB, 2G)",
              byte_size),
    EngineArg("gpu_memory_utilization", "cache", "CUDA: fraction of device memory to use",
              positive_float),
    EngineArg("enable_prefix_caching", "cache", "reuse the KV of shared prompt prefixes",
              switch=True),
    EngineArg("kv_cache_dtype", "cache", "KV cache storage (auto: the activations' dtype; "
              "bfloat16 on the CPU halves the bytes decode attention reads, sums stay fp32)",
              choices=get_args(KVCacheDType)),
    EngineArg("max_num_seqs", "scheduler", "requests in one step", positive_int),
    EngineArg("max_num_batched_tokens", "scheduler", "tokens in one step", positive_int),
    EngineArg("scheduling_policy", "scheduler", "the order waiting requests are admitted in",
              choices=get_args(SchedulingPolicy)),
    EngineArg("fair_prompt_weight", "scheduler",
              "fair policy: service charged per prompt token computed", non_negative_float),
    EngineArg("fair_output_weight", "scheduler",
              "fair policy: service charged per token generated", non_negative_float),
    EngineArg("max_loras", "lora", "distinct adapters one step may use (at most 256)",
              positive_int),
    EngineArg("lora_memory", "lora",
              "device memory for adapter pages: bytes (150MB, 1.5GiB, 2G) or a fraction of the "
              "KV cache (0.25); default: max_loras adapters at max_lora_rank", memory_size),
    EngineArg("lora_dtype", "lora", "adapter pool storage (auto: the model's dtype; float16 "
              "halves the adapter bytes each step reads)", choices=get_args(DType)),
    EngineArg("max_cpu_loras", "lora", "adapters kept in host memory", positive_int),
    EngineArg("max_lora_rank", "lora", "the largest adapter rank accepted", positive_int),
    EngineArg("speculative_config", "engine",
              'speculative decoding as JSON, e.g. \'{"method": "ngram", '
              '"num_speculative_tokens": 4}\' or \'{"method": "draft_model", "model": DIR, '
              '"num_speculative_tokens": 4}\'', speculative_json),
)  # fmt: skip
_BY_NAME = {a.name: a for a in ENGINE_ARGS}
_SIZES: tuple[Callable[[str], Any], ...] = (byte_size, memory_size)  # keywords may be "150MB"


class EngineKwargs(TypedDict, total=False):
    """The keywords ``LLM(...)`` and ``engine_config`` take (each an ``EngineArg``)."""

    dtype: DType
    device: str
    max_model_len: int | None
    seed: int
    attention_backend: AttentionBackendName
    enforce_eager: bool
    tensor_parallel_size: int
    block_size: int
    num_blocks: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    kv_cache_dtype: KVCacheDType
    max_num_seqs: int
    max_num_batched_tokens: int
    scheduling_policy: SchedulingPolicy
    fair_prompt_weight: float
    fair_output_weight: float
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    lora_memory: int | float | None
    lora_dtype: DType
    # a dict as vLLM takes it ({"method": "ngram", "num_speculative_tokens": 4}), or the record
    speculative_config: SpeculativeConfig | Mapping[str, Any] | None


def engine_config(model: str | None = None, **knobs: Any) -> EngineConfig:
    """``EngineConfig`` from keywords (``LLM``'s); a keyword not given keeps the default."""
    unknown = sorted(set(knobs) - set(_BY_NAME))
    if unknown:
        raise TypeError(
            f"unknown engine option(s) {', '.join(unknown)}; the options are {', '.join(_BY_NAME)}"
        )
    sections: dict[Section, dict[str, Any]] = {s: {} for s in _RECORDS if s != "engine"}
    sections["model"]["model"] = model
    top: dict[str, Any] = {}
    for name, value in knobs.items():
        arg = _BY_NAME[name]
        if isinstance(value, str) and arg.type in _SIZES:  # LLM(kv_cache_memory="150MB")
            try:
                value = arg.type(value)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"{name}: {exc}") from None
        if arg.section == "engine":
            top[name] = speculative_config_of(value) if name == "speculative_config" else value
        else:
            sections[arg.section][name] = value
    return EngineConfig(**{s: _RECORDS[s](**kw) for s, kw in sections.items()}, **top)


def knobs_of(config: EngineConfig) -> dict[str, Any]:
    """Every knob's value in ``config`` (the inverse of ``engine_config``)."""
    return {a.name: _value_of(config, a) for a in ENGINE_ARGS}


def _value_of(config: EngineConfig, arg: EngineArg) -> Any:
    record = config if arg.section == "engine" else getattr(config, arg.section)
    return getattr(record, arg.name)


def add_engine_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    env: bool = False,
    names: Collection[str] | None = None,
    environ: Mapping[str, str] = os.environ,
    defaults_shown: Mapping[str, str] | None = None,
) -> None:
    """Add the engine's flags (``names``: only those). With ``env``, ``LORAPLEX_<NAME>`` gives a
    flag's default. A flag not given is None (``from_args`` then keeps the config's default).
    ``defaults_shown``: the default to name in a flag's help where the command picks its own."""
    for arg in ENGINE_ARGS:
        if names is not None and arg.name not in names:
            continue
        default = _from_env(arg, environ) if env else None
        shown = (defaults_shown or {}).get(arg.name, arg.default)
        help_text = f"{arg.help} (default {shown}" + (f"; env {arg.env})" if env else ")")
        if arg.switch:
            parser.add_argument(
                arg.flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            parser.add_argument(
                arg.flag, type=arg.type, choices=arg.choices, default=default, help=help_text
            )


def from_args(args: argparse.Namespace, model: str | None = None) -> EngineConfig:
    """``EngineConfig`` from parsed flags (those ``add_engine_arguments`` added and were set)."""
    knobs = {a.name: getattr(args, a.name) for a in ENGINE_ARGS if hasattr(args, a.name)}
    return engine_config(model, **{k: v for k, v in knobs.items() if v is not None})


def _from_env(arg: EngineArg, environ: Mapping[str, str]) -> Any:
    raw = environ.get(arg.env)
    if raw is None:
        return None
    cast = env_bool if arg.switch else arg.type
    try:
        value = cast(raw)
    except (ValueError, argparse.ArgumentTypeError):
        raise ValueError(f"{arg.env}={raw!r} is not a valid value for {arg.flag}") from None
    if arg.choices is not None and value not in arg.choices:
        raise ValueError(f"{arg.env}={raw!r}: {arg.flag} is one of {', '.join(arg.choices)}")
    return value
