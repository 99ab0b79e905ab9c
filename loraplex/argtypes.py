"""``argparse`` types shared by every command (a leaf: imports nothing of loraplex). Each
refuses a bad value with a message naming what was expected."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """A whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def env_bool(text: str) -> bool:
    """An environment variable's switch: 1/true/yes/on or 0/false/no/off."""
    if text.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if text.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 1/true/yes/on or 0/false/no/off, got {text!r}")


# One syntax for every byte size (--kv-cache-memory, --lora-memory, --max-request-bytes,
# LORAPLEX_MAX_ADAPTER_BYTES, ...): a whole number of bytes, or a number and a unit. K, M, G, T
# (KB, MB, GB, TB) are powers of 1000; KiB, MiB, GiB, TiB (Ki, Mi, Gi, Ti) powers of 1024; case
# and "_" do not matter.
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
    "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}  # fmt: skip
SIZE_HINT = "a size such as 150MB, 1.5GiB, 2G or 157286400 (bytes)"
_MEMORY_HINT = "a size such as 150MB, 1.5GiB, 2G or 157286400 (bytes), or a fraction in (0, 1]"


def parse_size(text: str, hint: str = SIZE_HINT) -> int:
    """Bytes from ``150MB``, ``1.5GiB``, ``2G`` or ``157286400``; ``ValueError`` saying what a
    size looks like (for settings; ``byte_size`` is the ``argparse`` type)."""
    raw = text.strip().lower().replace("_", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :]
    if number and unit not in _UNITS:
        raise ValueError(f"unknown unit {unit!r} in {text!r}: expected {hint}")
    try:
        # A plain integer exactly (a float would round past 2**53); anything else as a float.
        value: int | float = int(number) if number.isdigit() else float(number)
    except ValueError:
        raise ValueError(f"expected {hint}, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number: expected {hint}")
    if value <= 0:
        raise ValueError(f"a size must be more than 0, got {text!r}")
    if not unit and not float(value).is_integer():
        raise ValueError(f"{text!r} is not a whole number of bytes: expected {hint}")
    size = int(value * _UNITS[unit])
    if size < 1:
        raise ValueError(f"a size must be at least 1 byte, got {text!r}")
    return size


def byte_size(text: str) -> int:
    """``argparse`` type of a byte size (``parse_size``)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def memory_size(text: str) -> int | float:
    """A byte size (``parse_size``) or a fraction in (0, 1] written with a point (``0.25``,
    ``1.0``)."""
    raw = text.strip()
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if "." in raw and 0 < value <= 1:
        return value  # a fraction
    try:
        return parse_size(text, _MEMORY_HINT)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
