"""``argparse`` types shared by every command (a leaf: imports nothing of loraplex). Each
refuses a bad value with a message naming what was expected."""

from __future__ import annotations

import argparse


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


_UNITS = {
    "": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
}  # fmt: skip


def memory_size(text: str) -> int | float:
    """Bytes (``1500000``, ``625MB``, ``2GiB``) or a fraction in (0, 1] (``0.25``)."""
    raw = text.strip().lower().replace("_", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :]
    hint = "bytes such as 625MB or 2GiB, or a fraction in (0, 1] such as 0.25"
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"unknown unit {unit!r} in {text!r}: expected {hint}")
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {hint}, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    if not unit and value <= 1 and "." in number:
        return value  # a fraction
    size = int(value * _UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size
