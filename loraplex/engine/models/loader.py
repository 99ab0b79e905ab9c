"""Load a local Hugging Face checkpoint directory into our models, strictly.

Every model parameter (every slice of a packed one) must come from the checkpoint exactly once,
and every checkpoint tensor must land somewhere: anything else is one ``ValueError`` naming the
offending weights, raised before any tensor data is read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from loraplex.engine.models import ARCHITECTURES
from loraplex.engine.models.layers import Linear
from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.models.parallel import SINGLE, TPGroup, VocabParallelEmbedding
from loraplex.engine.models.precision import Precision, resolve_precision

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know about the model: KV sizing and request validation."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int  # the longest context the model supports
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of K and V for one block in all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def architecture_of(hf_config: Any) -> type[LlamaForCausalLM]:
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(
        f"unsupported model architecture {names or '(none in config.json)'}; "
        f"supported: {', '.join(ARCHITECTURES)}"
    )


def max_positions(hf_config: Any) -> int:
    limit = int(hf_config.max_position_embeddings)
    window = getattr(hf_config, "sliding_window", None)
    if "MistralForCausalLM" in (hf_config.architectures or []) and window:
        limit = min(limit, int(window))  # no sliding-window attention: stay inside one window
    return limit


def build_spec(model_dir: str, hf_config: Any, dtype: torch.dtype) -> ModelSpec:
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    return ModelSpec(
        architecture=architecture_of(hf_config).__name__,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        head_dim=head_dim,
        hidden_size=hf_config.hidden_size,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=max_positions(hf_config),
        eos_token_ids=eos_token_ids(model_dir, hf_config),
        dtype=dtype,
    )


def eos_token_ids(model_dir: str, hf_config: Any) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (first) and ``config.json``, deduplicated."""
    found: list[int] = []
    sources: list[Any] = []
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f).get("eos_token_id"))
    sources.append(getattr(hf_config, "eos_token_id", None))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in found:
                found.append(token)
    return tuple(found)


def checkpoint_files(model_dir: str) -> dict[str, str]:
    """``{weight name: safetensors file}`` of a single-file or sharded checkpoint."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ValueError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir} "
        "(pickle checkpoints are not loaded)"
    )


def _target(model: LlamaForCausalLM, name: str) -> tuple[str, str] | None:
    """Checkpoint name -> (our parameter name, shard); packed projections map into their slice."""
    module_path, _, _ = name.rpartition(".")
    for packed, shards in model.packed_modules.items():
        for shard in shards:
            if module_path.endswith("." + shard):
                return name.replace(f".{shard}.", f".{packed}."), shard
    return name, ""


def _expected(model: LlamaForCausalLM) -> set[tuple[str, str]]:
    expected: set[tuple[str, str]] = set()
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            shards = module.output_slices if isinstance(module, Linear) else {"": (0, 0)}
            expected.update((full, shard) for shard in shards)
    return expected


def _summarise(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def load_weights(model: LlamaForCausalLM, model_dir: str) -> None:
    files = checkpoint_files(model_dir)
    expected = _expected(model)
    plan: dict[str, tuple[str, str]] = {}
    unexpected: list[str] = []
    for name in files:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied embeddings: the head is the embedding matrix
        target = _target(model, name)
        if target is None or target not in expected:
            unexpected.append(name)
        else:
            plan[name] = target
    missing = expected - set(plan.values())
    problems = []
    if missing:
        problems.append(
            f"missing weights: {_summarise([f'{p}[{s}]' if s else p for p, s in missing])}"
        )
    if unexpected:
        problems.append(f"unexpected weights: {_summarise(unexpected)}")
    if problems:
        raise ValueError(
            f"checkpoint {model_dir} does not match {type(model).__name__}: " + "; ".join(problems)
        )

    by_file: dict[str, list[str]] = {}
    for name in plan:
        by_file.setdefault(files[name], []).append(name)
    params = dict(model.named_parameters())
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                param_name, shard = plan[name]
                module_name, _, attr = param_name.rpartition(".")
                module = model.get_submodule(module_name)
                tensor = f.get_tensor(name)
                try:
                    if isinstance(module, Linear):
                        module.load_shard(attr, shard, tensor)  # narrows to the rank's share
                    elif isinstance(module, VocabParallelEmbedding):
                        module.load_weight(tensor)
                    else:
                        _copy(params[param_name], tensor)
                except ValueError as e:
                    raise ValueError(f"weight {name} in {path}: {e}") from None


def _copy(param: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(tensor.shape)}, model expects {tuple(param.shape)}"
        )
    param.data.copy_(tensor)


def load_model(
    model_dir: str,
    dtype: str | torch.dtype | Precision = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    tp: TPGroup = SINGLE,
) -> tuple[LlamaForCausalLM, Any]:
    """Build the model of ``model_dir/config.json`` and fill it from its safetensors.

    ``max_model_len`` sizes the rope tables (default: the model's maximum context); ``tp``: build
    and load this rank's share only.
    """
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    hf_config = AutoConfig.from_pretrained(model_dir)
    cls = architecture_of(hf_config)
    dev = resolve_device(device)
    precision = dtype if isinstance(dtype, Precision) else resolve_precision(dtype, dev)
    max_position = max_model_len or max_positions(hf_config)
    model = cls(hf_config, max_position, precision.dtype, dev, tp)
    load_weights(model, model_dir)
    model.pack_weights(precision.gemm_dtype)
    return model.eval(), hf_config
