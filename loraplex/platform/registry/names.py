"""Adapter names and references: ``name`` (the latest ready version) or ``name@N``.

A name is 1-64 characters of ``[A-Za-z0-9._-]`` not starting with ``.``: it can never hold a
path separator, a control character or ``@`` (which separates the version), so a name is safe in
URLs, logs and metric labels. It must also differ from the base model's served name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loraplex.platform.errors import APIError, clip

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
# N in name@N: 1 to 999,999,999, inside every database's integer; any other N (0, 10**20, '²')
# names no adapter, answered as one that does not exist (404), never a query with it.
_VERSION = re.compile(r"[1-9][0-9]{0,8}")


@dataclass(frozen=True)
class AdapterRef:
    name: str
    version: int | None  # None: the latest ready version

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


def check_adapter_name(name: str, base_name: str, param: str = "name") -> str:
    """``name`` if it may name a tenant's adapter; else a 400 that says what a name may be."""
    if not NAME_PATTERN.fullmatch(name):
        raise APIError(
            400,
            f"Invalid adapter name {clip(name, 70)}: a name is 1-64 characters of letters, digits, "
            "'.', '_' and '-', not starting with '.' (no '/', '@', spaces or control "
            "characters); for example 'support-bot'.",
            param=param,
            code="invalid_adapter_name",
        )
    if name == base_name:
        raise APIError(
            400,
            f"{name!r} is the base model's name; choose another name for the adapter.",
            param=param,
            code="adapter_name_reserved",
        )
    return name


def parse_ref(text: str) -> AdapterRef | None:
    """``name`` or ``name@N`` (N >= 1); None when ``text`` cannot refer to an adapter."""
    name, at, version = text.partition("@")
    if not NAME_PATTERN.fullmatch(name):
        return None
    if not at:
        return AdapterRef(name, None)
    if not _VERSION.fullmatch(version):
        return None
    return AdapterRef(name, int(version))
