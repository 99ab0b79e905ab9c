"""Check an upload as the engine will (``loraplex.lora.adapter.check_adapter``, the checks of
``load_adapter``), off the event loop.

Runs in a worker thread: ``check_adapter`` reads the safetensors file from disk (its header
bounded, then one tensor at a time through a fixed-size buffer) and checks every tensor, keeping
no weights, so an upload's validation holds one buffer whatever its size. The content hash it
returns is ``LoRAAdapter.content_hash``, the engine's key for the adapter. torch is imported only
here, when the first upload arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.lora.errors import AdapterError
from loraplex.platform.errors import APIError
from loraplex.platform.registry.storage import CONFIG_NAME, WEIGHTS_NAME
from loraplex.platform.registry.upload import ACCEPTED, FileRole

if TYPE_CHECKING:
    from loraplex.lora.adapter import BaseModelInfo

# AdapterError codes answered 413 (too large); every other code is a 400 with its own code.
TOO_LARGE_CODES = frozenset({"too_large", "archive_too_large"})


@dataclass(frozen=True)
class ValidatedAdapter:
    content_hash: str  # the engine's key (LoRAAdapter.content_hash)
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int  # bytes stored on disk (config + weights)
    adapter_dir: Path  # holds CONFIG_NAME and WEIGHTS_NAME, inside the upload's directory


def base_model_info(model_dir: str) -> BaseModelInfo:
    """The base model's geometry from its ``config.json`` (what the engine checks against)."""
    from transformers import AutoConfig

    from loraplex.lora.adapter import BaseModelInfo

    return BaseModelInfo.from_hf_config(AutoConfig.from_pretrained(model_dir))


def validate_upload(
    received: dict[FileRole, Path],
    work_dir: Path,
    base: BaseModelInfo,
    *,
    max_rank: int,
    max_bytes: int,
) -> ValidatedAdapter:
    """Validate the received files (roles ``config``/``weights`` or ``archive``); raises
    ``AdapterError`` for a bad adapter. Archives are extracted under ``work_dir``."""
    from loraplex.lora.adapter import AdapterError, check_adapter, extract_archive

    archive = received.get("archive")
    if archive is not None:
        adapter_dir = extract_archive(archive, work_dir / "extracted", max_bytes=max_bytes)
        archive.unlink()  # the extracted files are what is kept
    elif "config" in received and "weights" in received:
        adapter_dir = received["config"].parent
    else:
        missing = CONFIG_NAME if "config" not in received else WEIGHTS_NAME
        raise AdapterError("missing_file", f"the upload has no {missing}; {ACCEPTED}")
    adapter = check_adapter(adapter_dir, base, max_rank=max_rank, max_bytes=max_bytes)
    size = sum((adapter_dir / n).stat().st_size for n in (CONFIG_NAME, WEIGHTS_NAME))
    return ValidatedAdapter(
        content_hash=adapter.content_hash,
        rank=adapter.rank,
        alpha=adapter.alpha,
        target_modules=tuple(adapter.target_modules),
        size_bytes=size,
        adapter_dir=adapter_dir,
    )


def as_adapter_error(exc: ValueError) -> AdapterError | None:
    """``exc`` if it is the validator's (or the engine's) ``AdapterError``."""
    return exc if isinstance(exc, AdapterError) else None


def adapter_error(exc: AdapterError) -> APIError:
    """The API answer to an adapter the validator (or the engine) refused."""
    message = exc.message.rstrip(".")
    status = 413 if exc.code in TOO_LARGE_CODES else 400
    return APIError(
        status, f"The adapter was refused: {message}.", param="file", code=str(exc.code)
    )
