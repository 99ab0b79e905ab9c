"""Load and validate a tenant's PEFT LoRA adapter, refusing anything loraplex would serve wrongly.

An adapter is a directory (or a ``.zip`` / ``.tar.gz`` of one) holding ``adapter_config.json``
and ``adapter_model.safetensors``. Only ``json`` and ``safetensors`` ever read it: nothing is
unpickled. Every check raises :class:`AdapterError` with a ``code`` and a message that says what
to change, so an upload fails at upload time, never at the first request.

Order of checks: files → config → safetensors header (parsed here, offsets and sizes verified)
→ tensor names and shapes against the base model → tensor data (finite values). Tensor data is
handed to ``safetensors`` only after its header passed.

Tenant-supplied regular expressions (``target_modules`` as a string, ``rank_pattern`` and
``alpha_pattern`` keys, ``layers_pattern``) are evaluated with the ``regex`` module under one
shared time budget, so a pathological pattern cannot stall the process.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import regex
import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load

from loraplex.lora.archive import CONFIG_NAME, AdapterError, extract_archive

__all__ = [
    "CONFIG_NAME",
    "SUPPORTED_MODULES",
    "WEIGHTS_NAME",
    "AdapterError",
    "BaseModelInfo",
    "LoRAAdapter",
    "extract_archive",
    "load_adapter",
]

WEIGHTS_NAME = "adapter_model.safetensors"
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {m: "self_attn" for m in SUPPORTED_MODULES[:4]} | {
    m: "mlp" for m in SUPPORTED_MODULES[4:]
}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_FLOAT_DTYPES = {"F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2), "F32": (torch.float32, 4)}
_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 8 << 20
_MAX_PATTERN_CHARS = 1000
_PATTERN_BUDGET_S = 1.0
_HASH_FORMAT = "loraplex-lora-v1"
_TENSOR_NAME = regex.compile(
    r"base_model\.model\.model\.layers\.(0|[1-9][0-9]{0,5})\.(self_attn|mlp)\.([a-z_0-9]+)"
    r"\.lora_(A|B)(?:\.default)?\.weight"
)
# LoRA variants whose forward pass differs from y += s * B A x: refused, with the code to use.
_REFUSED_OPTIONS: dict[str, Literal["unsupported_option", "unsupported_target"]] = {
    "alora_invocation_tokens": "unsupported_option",
    "arrow_config": "unsupported_option",
    "kasa_config": "unsupported_option",
    "monteclora_config": "unsupported_option",
    "use_bdlora": "unsupported_option",
    "use_qalora": "unsupported_option",
    "layer_replication": "unsupported_option",
    "trainable_token_indices": "unsupported_target",
    "target_parameters": "unsupported_target",
}

ModuleKey = tuple[int, str]  # (layer index, module name such as "q_proj")


@dataclass(frozen=True)
class BaseModelInfo:
    """The base model's geometry: what an adapter's shapes are checked against."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> BaseModelInfo:
        heads = int(hf_config.num_attention_heads)
        archs = list(getattr(hf_config, "architectures", None) or [])
        return cls(
            architecture=str(archs[0]) if archs else str(getattr(hf_config, "model_type", "")),
            num_layers=int(hf_config.num_hidden_layers),
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            num_heads=heads,
            num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
        )

    def module_shape(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of one projection of a decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        if module not in shapes:
            raise _unsupported_target([module])
        return shapes[module]

    def module_name(self, key: ModuleKey) -> str:
        """The Hugging Face module name, e.g. ``model.layers.0.self_attn.q_proj``."""
        layer, module = key
        return f"model.layers.{layer}.{_PARENT[module]}.{module}"

    def other_module_names(self) -> list[str]:
        """Module names of a Llama-family model that LoRA may not target here, leaves first."""
        names = ["lm_head", "model.embed_tokens", "model.norm", "model.rotary_emb"]
        containers = ["", "model", "model.layers"]
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}"
            names += [f"{p}.input_layernorm", f"{p}.post_attention_layernorm", f"{p}.mlp.act_fn"]
            names += [f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm"]
            containers += [p, f"{p}.self_attn", f"{p}.mlp"]
        return names + containers

    def all_keys(self) -> list[ModuleKey]:
        return [(layer, m) for layer in range(self.num_layers) for m in SUPPORTED_MODULES]


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A validated adapter, ready for the engine: ``y += scaling * (x @ A.T) @ B.T`` per module.

    ``rank`` is the largest rank of any module (the slot width the engine needs); ``scaling`` is
    the config's default ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). With ``rank_pattern`` or
    ``alpha_pattern`` modules differ: always use :meth:`rank_of` and :meth:`scaling_of`.
    ``size_bytes`` is the memory held by ``weights`` (float32).
    """

    name: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    weights: Mapping[ModuleKey, tuple[torch.Tensor, torch.Tensor]]  # (A [r, in], B [out, r])
    content_hash: str
    size_bytes: int
    base_model_name_or_path: str | None
    scalings: Mapping[ModuleKey, float]
    use_rslora: bool = False

    def rank_of(self, layer: int, module: str) -> int:
        return int(self.weights[(layer, module)][0].shape[0])

    def scaling_of(self, layer: int, module: str) -> float:
        return self.scalings[(layer, module)]

    @property
    def uniform(self) -> bool:
        """True when every module has rank ``rank`` and scaling ``scaling``."""
        return all(
            self.rank_of(*k) == self.rank and s == self.scaling for k, s in self.scalings.items()
        )

    def delta_weight(self, layer: int, module: str) -> torch.Tensor:
        """``scaling * B @ A``: what merging this module into the base weight would add."""
        a, b = self.weights[(layer, module)]
        return self.scaling_of(layer, module) * (b @ a)  # [out, in]


def load_adapter(
    source: str | Path,
    base: BaseModelInfo,
    *,
    max_rank: int,
    name: str | None = None,
    max_bytes: int = 2 << 30,
) -> LoRAAdapter:
    """Load and validate the adapter at ``source``: a directory, or a zip / tar.gz / tar file.

    An archive is extracted into a fresh directory from :func:`tempfile.mkdtemp`, removed before
    this returns or raises: nothing is left on disk either way. ``max_bytes`` bounds the extracted
    archive and the weights file. A directory ``source`` is trusted as a local path (the operator's
    or the platform's own storage): its files may be symlinks, as in the Hugging Face cache.
    """
    source = Path(source)
    if source.is_dir():
        return _load_dir(source, base, max_rank, name or source.name, max_bytes)
    if not source.is_file():
        raise AdapterError(
            "missing_file",
            f"adapter {source} does not exist; pass a PEFT adapter directory or a .zip/.tar.gz of one",
        )
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-adapter-"))
    try:
        adapter_dir = extract_archive(source, tmp / "x", max_bytes=max_bytes)
        return _load_dir(adapter_dir, base, max_rank, name or _archive_stem(source), max_bytes)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _archive_stem(path: Path) -> str:
    for suffix in (".tar.gz", ".tgz", ".zip", ".tar"):
        if path.name.lower().endswith(suffix):
            return path.name[: -len(suffix)]
    return path.stem


# --- files and config ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    r: int
    alpha: float
    use_rslora: bool
    ranks: dict[ModuleKey, int]  # every targeted module -> its rank
    alphas: dict[ModuleKey, float]  # every targeted module -> its lora_alpha
    base_model_name_or_path: str | None

    def scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _load_dir(
    directory: Path, base: BaseModelInfo, max_rank: int, name: str, max_bytes: int
) -> LoRAAdapter:
    _check_files(directory)
    cfg = _parse_config(_read_json(directory / CONFIG_NAME), base, max_rank)
    data = _read_bounded(directory / WEIGHTS_NAME, max_bytes)
    header = _parse_header(data)
    pairs = _pair_tensors(header, base, cfg)
    weights = _load_weights(data, header, pairs)
    scalings = {k: cfg.scaling(cfg.ranks[k], cfg.alphas[k]) for k in pairs}
    return LoRAAdapter(
        name=name,
        rank=max(cfg.ranks[k] for k in pairs),
        alpha=cfg.alpha,
        scaling=cfg.scaling(cfg.r, cfg.alpha),
        target_modules=tuple(sorted({m for _, m in pairs})),
        weights=MappingProxyType(weights),
        content_hash=_content_hash(data, header, pairs, cfg, scalings),
        size_bytes=sum(a.nbytes + b.nbytes for a, b in weights.values()),
        base_model_name_or_path=cfg.base_model_name_or_path,
        scalings=MappingProxyType(scalings),
        use_rslora=cfg.use_rslora,
    )


def _check_files(directory: Path) -> None:
    if not (directory / WEIGHTS_NAME).is_file():
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise AdapterError(
                "pickle_format",
                f"{', '.join(pickles)} is a pickle-format checkpoint, which loraplex never loads "
                f"(unpickling can run arbitrary code); convert with "
                f"`model.save_pretrained(dir, safe_serialization=True)` and upload {WEIGHTS_NAME}",
            )
    for required in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / required).is_file():
            raise AdapterError(
                "missing_file",
                f"the adapter has no {required}; upload the directory written by PEFT's "
                f"`model.save_pretrained(dir)` ({CONFIG_NAME} + {WEIGHTS_NAME})",
            )


def _read_bounded(path: Path, limit: int) -> bytes:
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise AdapterError(
            "too_large",
            f"{path.name} is larger than {limit} bytes; lower the rank or the number of target "
            f"modules, or ask the operator to raise the adapter size limit",
        )
    return data


def _read_json(path: Path) -> dict[str, Any]:
    text = _read_bounded(path, _MAX_CONFIG_BYTES)
    try:
        raw = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad_config(f"{CONFIG_NAME} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise _bad_config(f"{CONFIG_NAME} must hold a JSON object")
    return raw


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a number")


def _bad_config(problem: str) -> AdapterError:
    return AdapterError(
        "bad_config",
        f"{problem}; fix {CONFIG_NAME} (as written by PEFT's `save_pretrained`) and upload again",
    )


def _unsupported_target(names: list[str]) -> AdapterError:
    return AdapterError(
        "unsupported_target",
        f"LoRA on {', '.join(map(repr, names[:5]))} is not supported; loraplex serves LoRA on "
        f"{', '.join(SUPPORTED_MODULES)} only: retrain with target_modules among those",
    )


def _parse_config(raw: dict[str, Any], base: BaseModelInfo, max_rank: int) -> _Config:
    _check_options(raw)
    r = _positive_int(raw.get("r", 8), "r")
    alpha = _positive_number(raw.get("lora_alpha", 8), "lora_alpha")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _bad_config(f"use_rslora must be true or false, got {use_rslora!r}")
    matcher = _Matcher()
    targets = _resolve_targets(raw, base, matcher)
    ranks = _apply_pattern(raw, "rank_pattern", targets, base, matcher, r, _positive_int)
    alphas = _apply_pattern(raw, "alpha_pattern", targets, base, matcher, alpha, _positive_number)
    for key, rank in ranks.items():
        if rank > max_rank:
            raise AdapterError(
                "rank_too_large",
                f"LoRA rank {rank} (on {base.module_name(key)}) exceeds this server's maximum "
                f"rank {max_rank}; retrain with r <= {max_rank} or ask the operator to raise "
                f"max_lora_rank",
            )
    base_name = raw.get("base_model_name_or_path")
    return _Config(
        r, alpha, use_rslora, ranks, alphas, base_name if isinstance(base_name, str) else None
    )


def _check_options(raw: dict[str, Any]) -> None:
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise _bad_config(f'peft_type is {peft_type!r}, but only LoRA adapters ("LORA") are served')
    if raw.get("use_dora"):
        raise AdapterError(
            "dora_unsupported",
            "DoRA adapters (use_dora: true) are not supported; retrain with "
            "LoraConfig(use_dora=False)",
        )
    if raw.get("modules_to_save"):
        raise AdapterError(
            "modules_to_save",
            f"modules_to_save {raw['modules_to_save']!r} replaces whole base-model modules, which "
            f"loraplex does not serve per adapter; retrain with modules_to_save=None",
        )
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        raise AdapterError(
            "bias_unsupported",
            f"trained biases (bias={raw.get('bias')!r}, lora_bias={raw.get('lora_bias')!r}) are "
            f'not supported; retrain with LoraConfig(bias="none", lora_bias=False)',
        )
    for option, code in _REFUSED_OPTIONS.items():
        if raw.get(option):
            raise AdapterError(
                code,
                f"{option}={raw[option]!r} selects a LoRA variant loraplex does not serve; "
                f"retrain as a plain LoRA adapter without {option}",
            )


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _bad_config(f"{what} must be a positive integer, got {value!r}")
    return value


def _positive_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise _bad_config(f"{what} must be a positive number, got {value!r}")
    return float(value)


# --- target_modules and the pattern options --------------------------------------------------


class _Matcher:
    """Tenant-supplied regular expressions, evaluated under one shared time budget."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + _PATTERN_BUDGET_S

    def compile(self, pattern: Any, what: str) -> regex.Pattern[str]:
        if not isinstance(pattern, str) or len(pattern) > _MAX_PATTERN_CHARS:
            raise _bad_config(f"{what} must be a string of at most {_MAX_PATTERN_CHARS} characters")
        try:
            return regex.compile(pattern)
        except (regex.error, RecursionError, OverflowError) as e:
            raise _bad_config(f"{what} {pattern!r} is not a valid regular expression ({e})") from e

    def run(
        self, compiled: regex.Pattern[str], text: str, *, full: bool
    ) -> regex.Match[str] | None:
        remaining = self.deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            if full:
                return compiled.fullmatch(text, timeout=remaining)
            return compiled.match(text, timeout=remaining)
        except TimeoutError as e:
            raise _bad_config(
                f"the regular expression {compiled.pattern!r} takes too long to evaluate; "
                f"use a simpler pattern or a list of module names"
            ) from e


def _resolve_targets(raw: dict[str, Any], base: BaseModelInfo, matcher: _Matcher) -> set[ModuleKey]:
    """The (layer, module) pairs PEFT would wrap with LoRA, given this config and base model."""
    spec = raw.get("target_modules")
    excluded = _exclusion(raw.get("exclude_modules"), matcher)
    if isinstance(spec, str) and spec.lower() == "all-linear":
        return {k for k in base.all_keys() if not excluded(base.module_name(k))}
    if isinstance(spec, str):
        return _regex_targets(spec, base, matcher, excluded)
    if isinstance(spec, list) and spec and all(isinstance(t, str) for t in spec):
        return _list_targets(spec, raw, base, matcher, excluded)
    raise _bad_config(
        f"target_modules must be a non-empty list of module names or a regex string, got {spec!r}"
    )


def _exclusion(spec: Any, matcher: _Matcher) -> Callable[[str], bool]:
    if not spec:
        return lambda name: False
    if isinstance(spec, str):
        compiled = matcher.compile(spec, "exclude_modules")
        return lambda name: matcher.run(compiled, name, full=True) is not None
    if isinstance(spec, list) and all(isinstance(x, str) for x in spec):
        return lambda name: name in spec or any(name.endswith(f".{x}") for x in spec)
    raise _bad_config(f"exclude_modules must be a list of names or a regex string, got {spec!r}")


def _regex_targets(
    spec: str, base: BaseModelInfo, matcher: _Matcher, excluded: Callable[[str], bool]
) -> set[ModuleKey]:
    compiled = matcher.compile(spec, "target_modules")
    bad = [
        n
        for n in base.other_module_names()
        if not excluded(n) and matcher.run(compiled, n, full=True)
    ]
    if bad:
        raise _unsupported_target(bad)
    found = {
        k
        for k in base.all_keys()
        if not excluded(base.module_name(k))
        and matcher.run(compiled, base.module_name(k), full=True)
    }
    if not found:
        raise _bad_config(
            f"target_modules {spec!r} matches no module of the base model ({base.architecture}); "
            f"module names look like 'model.layers.0.self_attn.q_proj'"
        )
    return found


def _list_targets(
    spec: list[str],
    raw: dict[str, Any],
    base: BaseModelInfo,
    matcher: _Matcher,
    excluded: Callable[[str], bool],
) -> set[ModuleKey]:
    unsupported = [t for t in spec if t.rsplit(".", 1)[-1] not in SUPPORTED_MODULES]
    if unsupported:
        raise _unsupported_target(unsupported)
    layers = _layer_filter(raw, matcher)
    found = set()
    for key in base.all_keys():
        name = base.module_name(key)
        hit = name in spec or any(name.endswith(f".{t}") for t in spec)
        if hit and not excluded(name) and layers(name):
            found.add(key)
    return found


def _layer_filter(raw: dict[str, Any], matcher: _Matcher) -> Callable[[str], bool]:
    """PEFT's ``layers_to_transform`` / ``layers_pattern`` (applied to list targets only)."""
    wanted = raw.get("layers_to_transform")
    if wanted is None or wanted == []:
        return lambda name: True
    if isinstance(wanted, int) and not isinstance(wanted, bool):
        wanted = [wanted]
    if not isinstance(wanted, list) or not all(isinstance(i, int) for i in wanted):
        raise _bad_config(f"layers_to_transform must be an int or a list of ints, got {wanted!r}")
    patterns = raw.get("layers_pattern") or [r"[^.]*"]
    patterns = [patterns] if isinstance(patterns, str) else patterns
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise _bad_config(f"layers_pattern must be a string or a list of strings, got {patterns!r}")
    compiled = [
        matcher.compile(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", "layers_pattern") for p in patterns
    ]

    def keep(name: str) -> bool:
        for c in compiled:
            if m := matcher.run(c, name, full=False):
                return int(m.group("idx")) in wanted
        return False

    return keep


def _apply_pattern(
    raw: dict[str, Any],
    option: str,
    targets: set[ModuleKey],
    base: BaseModelInfo,
    matcher: _Matcher,
    default: Any,
    check: Any,
) -> dict[ModuleKey, Any]:
    """Per-module values from ``rank_pattern`` / ``alpha_pattern``: first matching key wins."""
    spec = raw.get(option) or {}
    if not isinstance(spec, dict):
        raise _bad_config(f"{option} must be an object mapping module patterns to values")
    compiled = [
        (matcher.compile(rf"(.*\.)?({key})$", option), check(value, f"{option}[{key!r}]"))
        for key, value in spec.items()
    ]
    out = {}
    for key in targets:
        name = base.module_name(key)
        out[key] = next((v for c, v in compiled if matcher.run(c, name, full=False)), default)
    return out


# --- safetensors ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def _bad_safetensors(problem: str) -> AdapterError:
    return AdapterError(
        "bad_safetensors",
        f"{WEIGHTS_NAME} is not a valid safetensors file: {problem}; re-save the adapter with "
        f"`model.save_pretrained(dir, safe_serialization=True)`",
    )


def _parse_header(data: bytes) -> dict[str, _TensorInfo]:
    """Parse and verify the header without trusting it; ``safetensors`` sees only files that pass.

    Layout: ``u64 little-endian N | N bytes of JSON | data``. Tensor byte ranges must tile the
    data section exactly (no gaps, no overlaps, nothing after), each as long as dtype × shape.
    """
    if len(data) < 8:
        raise _bad_safetensors("the file is shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER_BYTES or 8 + n > len(data):
        raise _bad_safetensors(
            f"the header length {n} exceeds the file or the {_MAX_HEADER_BYTES}-byte limit"
        )
    try:
        header = json.loads(
            data[8 : 8 + n], object_pairs_hook=_unique_keys, parse_constant=_no_constant
        )
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad_safetensors(f"the header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise _bad_safetensors("the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad_safetensors("__metadata__ must map strings to strings")
    infos = {name: _tensor_info(name, entry, 8 + n, len(data)) for name, entry in header.items()}
    _check_tiling(infos, 8 + n, len(data))
    return infos


def _tensor_info(name: str, entry: Any, start: int, stop: int) -> _TensorInfo:
    """One header entry; offsets are relative to ``start``, the first byte after the header."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _bad_safetensors(f"entry {name!r} must have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _FLOAT_DTYPES:
        raise AdapterError(
            "bad_dtype",
            f"tensor {name!r} has dtype {dtype!r}; LoRA weights must be float16, bfloat16 or "
            f"float32 (quantized or integer adapters are not served): re-save in one of those",
        )
    if not _int_list(shape) or len(shape) > 8 or not _int_list(offsets) or len(offsets) != 2:
        raise _bad_safetensors(f"entry {name!r} has a malformed shape or data_offsets")
    begin, end = offsets
    if not begin <= end <= stop - start:
        raise _bad_safetensors(
            f"tensor {name!r} lies outside the file (data_offsets {offsets}, "
            f"data section {stop - start} bytes)"
        )
    needed = math.prod(shape) * _FLOAT_DTYPES[dtype][1]
    if end - begin != needed:
        raise _bad_safetensors(
            f"tensor {name!r} spans {end - begin} bytes but {dtype} {shape} needs {needed}"
        )
    return _TensorInfo(dtype, tuple(shape), start + begin, start + end)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
    )


def _check_tiling(infos: dict[str, _TensorInfo], start: int, stop: int) -> None:
    cursor = start
    for name, info in sorted(infos.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != cursor:
            raise _bad_safetensors(f"tensor {name!r} overlaps another tensor or leaves a gap")
        cursor = info.end
    if cursor != stop:
        raise _bad_safetensors(f"{stop - cursor} bytes after the last tensor belong to no tensor")


# --- tensor names, shapes, values --------------------------------------------------------------


def _parse_name(name: str) -> tuple[int, str, str]:
    """``(layer, module, "A" | "B")`` of a PEFT LoRA tensor name; refuses everything else."""
    m = _TENSOR_NAME.fullmatch(name)
    if m is not None and _PARENT.get(m.group(3)) == m.group(2):
        return int(m.group(1)), m.group(3), m.group(4)
    if "lora_magnitude_vector" in name:
        raise AdapterError(
            "dora_unsupported",
            f"tensor {name!r} is a DoRA magnitude vector; retrain with use_dora=False",
        )
    if name.endswith(".bias"):
        raise AdapterError(
            "bias_unsupported",
            f'tensor {name!r} is a bias; retrain with bias="none" and lora_bias=False',
        )
    if m is not None or "embed" in name or "lm_head" in name:
        raise _unsupported_target([name])
    raise AdapterError(
        "unexpected_tensor",
        f"tensor {name!r} is not a PEFT LoRA weight (expected names like "
        f"'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'); save the adapter "
        f"with PEFT's `save_pretrained`",
    )


def _pair_tensors(
    header: dict[str, _TensorInfo], base: BaseModelInfo, cfg: _Config
) -> dict[ModuleKey, tuple[str, str]]:
    """(layer, module) -> (A name, B name), with shapes checked against the config and base."""
    found: dict[tuple[int, str, str], str] = {}
    for name in header:
        layer, module, which = _parse_name(name)
        if (layer, module, which) in found:
            raise AdapterError(
                "unexpected_tensor",
                f"tensors {found[layer, module, which]!r} and {name!r} are the same weight; keep one",
            )
        found[layer, module, which] = name
    pairs: dict[ModuleKey, tuple[str, str]] = {}
    for layer, module, _ in found:
        a, b = found.get((layer, module, "A")), found.get((layer, module, "B"))
        if a is None or b is None:
            raise AdapterError(
                "missing_tensor",
                f"{'lora_A' if a is None else 'lora_B'} of layer {layer} {module} is missing; upload the complete adapter",
            )
        pairs[(layer, module)] = (a, b)
    if not pairs:
        raise _bad_safetensors("it holds no LoRA weights")
    for key, (a, b) in sorted(pairs.items()):
        _check_pair(key, header[a].shape, header[b].shape, base, cfg)
    return pairs


def _check_pair(
    key: ModuleKey, a: tuple[int, ...], b: tuple[int, ...], base: BaseModelInfo, cfg: _Config
) -> None:
    layer, module = key
    where = base.module_name(key) if layer < base.num_layers else f"layer {layer} {module}"
    if layer >= base.num_layers:
        raise _mismatch(
            f"it has weights for layer {layer}, but the base model has {base.num_layers} layers",
            cfg,
            base,
        )
    if key not in cfg.ranks:
        raise AdapterError(
            "unexpected_tensor",
            f"it has weights for {where}, which target_modules does not select; fix "
            f"target_modules in {CONFIG_NAME} or remove those weights",
        )
    rank = cfg.ranks[key]
    if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
        raise AdapterError(
            "bad_shape",
            f"{where}: lora_A is {list(a)} and lora_B is {list(b)}, but rank {rank} from "
            f"{CONFIG_NAME} needs lora_A [{rank}, in] and lora_B [out, {rank}]; the weights do not "
            f"belong to this config",
        )
    fan_in, fan_out = base.module_shape(module)
    if a[1] != fan_in or b[0] != fan_out:
        raise _mismatch(
            f"{where} is {fan_in} -> {fan_out} in the base model, but the adapter has {a[1]} -> {b[0]}",
            cfg,
            base,
        )


def _mismatch(problem: str, cfg: _Config, base: BaseModelInfo) -> AdapterError:
    trained = (
        f" (its config names {cfg.base_model_name_or_path!r})"
        if cfg.base_model_name_or_path
        else ""
    )
    return AdapterError(
        "base_model_mismatch",
        f"the adapter was trained for a different base model{trained}: {problem}; this server "
        f"serves {base.architecture}, so retrain the adapter on that model",
    )


def _load_weights(
    data: bytes, header: dict[str, _TensorInfo], pairs: dict[ModuleKey, tuple[str, str]]
) -> dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]:
    try:
        tensors = safetensors_load(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise _bad_safetensors(str(e)) from e
    out = {}
    for key, names in sorted(pairs.items()):
        a, b = (_as_float32(n, tensors[n], header[n]) for n in names)
        out[key] = (a, b)
    return out


def _as_float32(name: str, tensor: torch.Tensor, info: _TensorInfo) -> torch.Tensor:
    if tuple(tensor.shape) != info.shape or tensor.dtype != _FLOAT_DTYPES[info.dtype][0]:
        raise _bad_safetensors(f"tensor {name!r} does not match its header")
    out = tensor.to(torch.float32, copy=True).contiguous()
    if not bool(torch.isfinite(out).all()):
        raise AdapterError(
            "nan_weights",
            f"tensor {name!r} contains NaN or Inf values; the training diverged: retrain (e.g. "
            f"with a lower learning rate) or fix the checkpoint",
        )
    return out


def _content_hash(
    data: bytes,
    header: dict[str, _TensorInfo],
    pairs: dict[ModuleKey, tuple[str, str]],
    cfg: _Config,
    scalings: dict[ModuleKey, float],
) -> str:
    """SHA-256 over what the adapter computes: per module rank and scaling, then every tensor.

    Tensors are named canonically (``layers.{i}.{module}.lora_{A|B}``) and hashed in sorted order
    with dtype, shape and the stored bytes, so file order, the ``.default`` segment, config fields
    that do not change the output, and archive packaging do not change the hash.
    """
    keys = sorted(pairs)
    manifest = {
        "format": _HASH_FORMAT,
        "modules": [
            [layer, m, cfg.ranks[(layer, m)], scalings[(layer, m)].hex()] for layer, m in keys
        ],
        "tensors": [
            [f"layers.{layer}.{m}.lora_{w}", header[n].dtype, list(header[n].shape)]
            for layer, m in keys
            for w, n in zip("AB", pairs[(layer, m)], strict=True)
        ],
    }
    blob = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    h = hashlib.sha256(len(blob).to_bytes(8, "little") + blob)
    view = memoryview(data)
    for key in keys:
        for n in pairs[key]:
            h.update(view[header[n].begin : header[n].end])
    return h.hexdigest()
