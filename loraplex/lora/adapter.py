"""Load and validate a tenant's PEFT LoRA adapter, refusing anything loraplex would serve wrongly.

An adapter is a directory (or a ``.zip`` / ``.tar.gz`` of one) holding ``adapter_config.json``
and ``adapter_model.safetensors``. Only ``json`` and ``safetensors`` ever read it: nothing is
unpickled. Every check raises :class:`AdapterError` with a ``code`` and a message that says what
to change, so an upload fails at upload time, never at the first request.

Order of checks: files → config → safetensors header (read bounded from the file, parsed and
verified by :mod:`loraplex.lora.archive`) → tensor names and shapes against the base model, before
any tensor data is read → tensor values (finite), read one tensor at a time through a fixed-size
buffer and hashed as they are read. :func:`check_adapter` runs every check and computes the
content hash without keeping the weights (the platform validates uploads with it, in memory of
one buffer); :func:`load_adapter` runs the same pass keeping each tensor as float32.

Tenant-supplied regular expressions (``target_modules`` as a string, ``rank_pattern`` and
``alpha_pattern`` keys, ``layers_pattern``) are evaluated with the ``regex`` module under one
shared time budget, so a pathological pattern cannot stall the process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import regex
import torch

from loraplex.lora.archive import (
    CONFIG_NAME,
    FLOAT_DTYPES,
    WEIGHTS_NAME,
    AdapterError,
    SafetensorsFile,
    TensorInfo,
    extract_archive,
    loads_strict,
    read_bounded,
    short_repr,
)

__all__ = [
    "CONFIG_NAME",
    "SUPPORTED_MODULES",
    "WEIGHTS_NAME",
    "AdapterError",
    "AdapterSummary",
    "BaseModelInfo",
    "LoRAAdapter",
    "check_adapter",
    "extract_archive",
    "load_adapter",
]

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = dict.fromkeys(SUPPORTED_MODULES[:4], "self_attn") | dict.fromkeys(
    SUPPORTED_MODULES[4:], "mlp"
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_MAX_CONFIG_BYTES = 1 << 20
# Bounds of the config's numbers, checked before any arithmetic on them (a 400-digit lora_alpha
# must be a clear refusal, not an OverflowError). Ranks beyond max_rank are refused after these.
MAX_CONFIG_RANK = 1 << 16
MAX_CONFIG_ALPHA = 1_000_000
MAX_LAYER_INDEX = 999_999  # as in tensor names (``layers.<up to 6 digits>.``)
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

    def describe(self) -> str:
        """The geometry adapters must match, for messages (never a path or a served name)."""
        return (
            f"{short_repr(self.architecture, 60)[1:-1]} with {self.num_layers} layers, hidden "
            f"size {self.hidden_size}, intermediate size {self.intermediate_size}, "
            f"{self.num_heads} attention heads ({self.num_kv_heads} key/value), head size "
            f"{self.head_dim}"
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
class AdapterSummary:
    """What validating an adapter establishes, without its weights (:func:`check_adapter`).

    The fields mean what :class:`LoRAAdapter`'s of the same names mean; ``content_hash`` is the
    same value ``load_adapter`` gives for the same files.
    """

    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    content_hash: str
    size_bytes: int  # float32 bytes of the weights, as the engine holds them
    base_model_name_or_path: str | None
    scalings: dict[ModuleKey, float]
    use_rslora: bool = False


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A validated adapter, ready for the engine: ``y += scaling * (x @ A.T) @ B.T`` per module.

    ``rank`` is the largest rank of any module (the slot width the engine needs); ``scaling`` is
    the config's default ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). With ``rank_pattern`` or
    ``alpha_pattern`` modules differ: always use :meth:`rank_of` and :meth:`scaling_of`.
    ``size_bytes`` is the memory held by ``weights`` (float32). Treat ``weights`` and
    ``scalings`` as read-only (plain dicts so that the record pickles between processes).
    """

    name: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]  # (A [r, in], B [out, r])
    content_hash: str
    size_bytes: int
    base_model_name_or_path: str | None
    scalings: dict[ModuleKey, float]
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
    Memory: the float32 weights, plus one read buffer.
    """
    with _adapter_dir(Path(source), max_bytes) as (directory, stem):
        summary, weights = _read_dir(directory, base, max_rank, max_bytes, keep_weights=True)
    fields = {f.name: getattr(summary, f.name) for f in dataclasses.fields(summary)}
    return LoRAAdapter(name=name or stem, weights=weights, **fields)


def check_adapter(
    source: str | Path, base: BaseModelInfo, *, max_rank: int, max_bytes: int = 2 << 30
) -> AdapterSummary:
    """Every check :func:`load_adapter` makes, and the same content hash, without keeping the
    weights: memory stays one read buffer whatever the file's size (upload validation)."""
    with _adapter_dir(Path(source), max_bytes) as (directory, _):
        summary, _ = _read_dir(directory, base, max_rank, max_bytes, keep_weights=False)
    return summary


@contextlib.contextmanager
def _adapter_dir(source: Path, max_bytes: int) -> Iterator[tuple[Path, str]]:
    """The directory holding the adapter's files (an archive extracted into a temporary one,
    removed on exit), and the adapter's default name."""
    if source.is_dir():
        yield source, source.name
        return
    if not source.is_file():
        raise AdapterError(
            "missing_file",
            f"adapter {source} does not exist; pass a PEFT adapter directory or a .zip/.tar.gz "
            f"of one",
        )
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-adapter-"))
    try:
        yield extract_archive(source, tmp / "x", max_bytes=max_bytes), _archive_stem(source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _archive_stem(path: Path) -> str:
    for suffix in (".tar.gz", ".tgz", ".zip", ".tar"):
        if path.name.lower().endswith(suffix):
            return path.name[: -len(suffix)]
    return path.stem


# --- files and config ----------------------------------------------------------------------------


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


Weights = dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]  # (A [r, in], B [out, r])


def _read_dir(
    directory: Path, base: BaseModelInfo, max_rank: int, max_bytes: int, *, keep_weights: bool
) -> tuple[AdapterSummary, Weights]:
    """One pass over the adapter's files: config, header, names and shapes (no tensor data
    read yet; the shape checks bound every tensor by ``max_rank`` and the base model), then
    each tensor in hash order, hashed and checked finite chunk by chunk. ``weights`` is empty
    unless ``keep_weights``."""
    _check_files(directory)
    cfg = _parse_config(_read_json(directory / CONFIG_NAME), base, max_rank)
    with SafetensorsFile(directory / WEIGHTS_NAME, max_bytes) as st:
        pairs = _pair_tensors(st.header, base, cfg)
        scalings = {k: cfg.scaling(cfg.ranks[k], cfg.alphas[k]) for k in pairs}
        digest = _hash_manifest(st.header, pairs, cfg, scalings)
        weights: Weights = {}
        for key in sorted(pairs):  # the hash's order
            a, b = (_read_tensor(st, n, digest, keep_weights) for n in pairs[key])
            if a is not None and b is not None:
                weights[key] = (a, b)
    summary = AdapterSummary(
        rank=max(cfg.ranks[k] for k in pairs),
        alpha=cfg.alpha,
        scaling=cfg.scaling(cfg.r, cfg.alpha),
        target_modules=tuple(sorted({m for _, m in pairs})),
        content_hash=digest.hexdigest(),
        size_bytes=sum(4 * math.prod(st.header[n].shape) for ab in pairs.values() for n in ab),
        base_model_name_or_path=cfg.base_model_name_or_path,
        scalings=scalings,
        use_rslora=cfg.use_rslora,
    )
    return summary, weights


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


def _read_json(path: Path) -> dict[str, Any]:
    text = read_bounded(path, _MAX_CONFIG_BYTES)
    try:
        raw = loads_strict(text)
    except ValueError as e:
        raise _bad_config(f"{CONFIG_NAME} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise _bad_config(f"{CONFIG_NAME} must hold a JSON object")
    return raw


def _bad_config(problem: str) -> AdapterError:
    return AdapterError(
        "bad_config",
        f"{problem}; fix {CONFIG_NAME} (as written by PEFT's `save_pretrained`) and upload again",
    )


def _unsupported_target(names: list[str]) -> AdapterError:
    return AdapterError(
        "unsupported_target",
        f"LoRA on {', '.join(map(short_repr, names[:5]))} is not supported; loraplex serves "
        f"LoRA on "
        f"{', '.join(SUPPORTED_MODULES)} only: retrain with target_modules among those",
    )


def _parse_config(raw: dict[str, Any], base: BaseModelInfo, max_rank: int) -> _Config:
    """Validate the config; missing keys take PEFT's defaults (r=8, lora_alpha=8, no rsLoRA)."""
    _check_options(raw)
    r = _rank(raw.get("r", 8), "r")
    alpha = _alpha(raw.get("lora_alpha", 8), "lora_alpha")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _bad_config(f"use_rslora must be true or false, got {short_repr(use_rslora)}")
    matcher = _Matcher()
    targets = _resolve_targets(raw, base, matcher)
    ranks = _apply_pattern(raw, "rank_pattern", targets, base, matcher, r, _rank)
    alphas = _apply_pattern(raw, "alpha_pattern", targets, base, matcher, alpha, _alpha)
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
        raise _bad_config(
            f'peft_type is {short_repr(peft_type)}, but only LoRA adapters ("LORA") are served'
        )
    if raw.get("use_dora"):
        raise AdapterError(
            "dora_unsupported",
            "DoRA adapters (use_dora: true) are not supported; retrain with "
            "LoraConfig(use_dora=False)",
        )
    if raw.get("modules_to_save"):
        raise AdapterError(
            "modules_to_save",
            f"modules_to_save {short_repr(raw['modules_to_save'])} replaces whole base-model "
            f"modules, which "
            f"loraplex does not serve per adapter; retrain with modules_to_save=None",
        )
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        raise AdapterError(
            "bias_unsupported",
            f"trained biases (bias={short_repr(raw.get('bias'))}, "
            f"lora_bias={short_repr(raw.get('lora_bias'))}) are "
            f'not supported; retrain with LoraConfig(bias="none", lora_bias=False)',
        )
    for option, code in _REFUSED_OPTIONS.items():
        if raw.get(option):
            raise AdapterError(
                code,
                f"{option}={short_repr(raw[option])} selects a LoRA variant loraplex does not "
                f"serve; "
                f"retrain as a plain LoRA adapter without {option}",
            )


def _rank(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_CONFIG_RANK:
        raise _bad_config(
            f"{what} must be a positive integer of at most {MAX_CONFIG_RANK}, got "
            f"{short_repr(value)}"
        )
    return value


def _alpha(value: Any, what: str) -> float:
    # int and float compare exactly, so a huge int is refused here before float() overflows
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= MAX_CONFIG_ALPHA
    ):
        raise _bad_config(
            f"{what} must be a positive number of at most {MAX_CONFIG_ALPHA}, got "
            f"{short_repr(value)}"
        )
    return float(value)


# --- target_modules and the pattern options ------------------------------------------------------


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
            raise _bad_config(
                f"{what} {short_repr(pattern)} is not a valid regular expression ({e})"
            ) from e

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
                f"the regular expression {short_repr(compiled.pattern)} takes too long to "
                f"evaluate; "
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
        f"target_modules must be a non-empty list of module names or a regex string, "
        f"got {short_repr(spec)}"
    )


def _exclusion(spec: Any, matcher: _Matcher) -> Callable[[str], bool]:
    if not spec:
        return lambda name: False
    if isinstance(spec, str):
        compiled = matcher.compile(spec, "exclude_modules")
        return lambda name: matcher.run(compiled, name, full=True) is not None
    if isinstance(spec, list) and all(isinstance(x, str) for x in spec):
        return lambda name: name in spec or any(name.endswith(f".{x}") for x in spec)
    raise _bad_config(
        f"exclude_modules must be a list of names or a regex string, got {short_repr(spec)}"
    )


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
            f"target_modules {short_repr(spec)} matches no module of the base model "
            f"({base.architecture}); module names look like 'model.layers.0.self_attn.q_proj'"
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
    spec = raw.get("layers_to_transform")
    if spec is None or spec == []:
        return lambda name: True
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = [spec]
    if not isinstance(spec, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_LAYER_INDEX for i in spec
    ):
        raise _bad_config(
            f"layers_to_transform must be a layer index or a list of them, each from 0 to "
            f"{MAX_LAYER_INDEX}, got {short_repr(spec)}"
        )
    wanted = frozenset(spec)
    patterns = raw.get("layers_pattern") or [r"[^.]*"]
    patterns = [patterns] if isinstance(patterns, str) else patterns
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise _bad_config(
            f"layers_pattern must be a string or a list of strings, got {short_repr(patterns)}"
        )
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
    check: Callable[[Any, str], Any],
) -> dict[ModuleKey, Any]:
    """Per-module values from ``rank_pattern`` / ``alpha_pattern``: first matching key wins."""
    spec = raw.get(option) or {}
    if not isinstance(spec, dict):
        raise _bad_config(f"{option} must be an object mapping module patterns to values")
    compiled = [
        (matcher.compile(rf"(.*\.)?({key})$", option), check(value, f"{option}[{short_repr(key)}]"))
        for key, value in spec.items()
    ]
    out = {}
    for key in targets:
        name = base.module_name(key)
        out[key] = next((v for c, v in compiled if matcher.run(c, name, full=False)), default)
    return out


# --- tensor names, shapes, values ----------------------------------------------------------------


def _parse_name(name: str) -> tuple[int, str, str]:
    """``(layer, module, "A" | "B")`` of a PEFT LoRA tensor name; refuses everything else."""
    m = _TENSOR_NAME.fullmatch(name)
    if m is not None and _PARENT.get(m.group(3)) == m.group(2):
        return int(m.group(1)), m.group(3), m.group(4)
    if "lora_magnitude_vector" in name:
        raise AdapterError(
            "dora_unsupported",
            f"tensor {short_repr(name)} is a DoRA magnitude vector; retrain with use_dora=False",
        )
    if name.endswith(".bias"):
        raise AdapterError(
            "bias_unsupported",
            f'tensor {short_repr(name)} is a bias; retrain with bias="none" and lora_bias=False',
        )
    if m is not None or "embed" in name or "lm_head" in name:
        raise _unsupported_target([name])
    raise AdapterError(
        "unexpected_tensor",
        f"tensor {short_repr(name)} is not a PEFT LoRA weight (expected names like "
        f"'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'); save the adapter "
        f"with PEFT's `save_pretrained`",
    )


def _pair_tensors(
    header: dict[str, TensorInfo], base: BaseModelInfo, cfg: _Config
) -> dict[ModuleKey, tuple[str, str]]:
    """(layer, module) -> (A name, B name), with shapes checked against the config and base."""
    found: dict[tuple[int, str, str], str] = {}
    for name in header:
        layer, module, which = _parse_name(name)
        if (layer, module, which) in found:
            raise AdapterError(
                "unexpected_tensor",
                f"tensors {short_repr(found[layer, module, which])} and {short_repr(name)} are "
                f"the same weight; keep one",
            )
        found[layer, module, which] = name
    pairs: dict[ModuleKey, tuple[str, str]] = {}
    for layer, module, _ in found:
        a, b = found.get((layer, module, "A")), found.get((layer, module, "B"))
        if a is None or b is None:
            raise AdapterError(
                "missing_tensor",
                f"{'lora_A' if a is None else 'lora_B'} of layer {layer} {module} is missing; "
                f"upload the complete adapter",
            )
        pairs[(layer, module)] = (a, b)
    if not pairs:
        raise AdapterError(
            "bad_safetensors",
            f"{WEIGHTS_NAME} holds no LoRA weights; save the trained adapter with PEFT's "
            f"`model.save_pretrained(dir)`",
        )
    for key, (a, b) in sorted(pairs.items()):
        _check_pair(key, header[a].shape, header[b].shape, base, cfg)
    return pairs


def _check_pair(
    key: ModuleKey, a: tuple[int, ...], b: tuple[int, ...], base: BaseModelInfo, cfg: _Config
) -> None:
    layer, module = key
    if layer >= base.num_layers:
        raise _mismatch(
            f"it has weights for layer {layer}, but the base model has {base.num_layers} layers",
            base,
        )
    where = base.module_name(key)
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
            f"{where} is {fan_in} -> {fan_out} in the base model, but the adapter has "
            f"{a[1]} -> {b[0]}",
            base,
        )


def _mismatch(problem: str, base: BaseModelInfo) -> AdapterError:
    # The geometry is what does not fit. The config's base_model_name_or_path is not quoted:
    # it is often a path on the trainer's machine (or this server's), and a matching name
    # proves nothing while a different one may be a copy of the same model.
    return AdapterError(
        "base_model_mismatch",
        f"the adapter's shapes do not fit this server's base model ({base.describe()}): "
        f"{problem}; it was trained on a model of another architecture or size, so train it "
        f"on the served base model",
    )


def _read_tensor(
    st: SafetensorsFile, name: str, digest: hashlib._Hash, keep: bool
) -> torch.Tensor | None:
    """Hash tensor ``name``'s stored bytes into ``digest`` and check them finite, one buffer at
    a time; the tensor as float32 when ``keep`` (else None: nothing is kept)."""
    info = st.header[name]
    dtype = FLOAT_DTYPES[info.dtype][0]
    out = torch.empty(info.shape, dtype=torch.float32) if keep else None
    flat = out.view(-1) if out is not None else None  # [numel]
    pos = 0
    for chunk in st.chunks(name):
        digest.update(chunk)
        values = torch.frombuffer(chunk, dtype=dtype)  # [chunk numel], a view of the buffer
        if not bool(torch.isfinite(values).all()):
            raise AdapterError(
                "nan_weights",
                f"tensor {short_repr(name)} contains NaN or Inf values; the training diverged: "
                f"retrain (e.g. with a lower learning rate) or fix the checkpoint",
            )
        if flat is not None:
            flat[pos : pos + values.numel()].copy_(values)
        pos += values.numel()
    return out


def _hash_manifest(
    header: dict[str, TensorInfo],
    pairs: dict[ModuleKey, tuple[str, str]],
    cfg: _Config,
    scalings: dict[ModuleKey, float],
) -> hashlib._Hash:
    """The content hash, started: SHA-256 over what the adapter computes, per module rank and
    scaling, then (fed by :func:`_read_tensor`, in sorted module order, A then B) every tensor.

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
    return hashlib.sha256(len(blob).to_bytes(8, "little") + blob)
