"""``AdapterError``: why loraplex refuses an adapter, with a machine-readable code.

A leaf module (no torch): the platform checks whether an exception is one without loading the
adapter code, and the error crosses the engine process boundary intact.
"""

from __future__ import annotations

from typing import Literal

AdapterErrorCode = Literal[
    "missing_file",
    "pickle_format",
    "bad_config",
    "unsupported_target",
    "unsupported_option",
    "dora_unsupported",
    "modules_to_save",
    "bias_unsupported",
    "rank_too_large",
    "pool_too_small",
    "bad_safetensors",
    "bad_dtype",
    "too_large",
    "unexpected_tensor",
    "missing_tensor",
    "bad_shape",
    "base_model_mismatch",
    "nan_weights",
    "bad_archive",
    "archive_too_large",
    "unsafe_archive_member",
]


class AdapterError(ValueError):
    """An adapter (or its archive) that loraplex refuses; ``str(err)`` says what to fix.

    ``code`` is a short machine-readable reason (see :data:`AdapterErrorCode`) for API error
    bodies and metrics labels.
    """

    def __init__(self, code: AdapterErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: AdapterErrorCode = code
        self.message = message

    def __reduce__(self) -> tuple[type[AdapterError], tuple[AdapterErrorCode, str]]:
        # Crosses the engine-core process boundary intact.
        return type(self), (self.code, self.message)
