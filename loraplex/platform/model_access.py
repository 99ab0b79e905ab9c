"""Which models an API key may use: its allowlist (``ApiKey.allowed_models``).

An allowlist is a list of model names as requests give them: the base model's served name (each
alias of it is a name of its own), an adapter's name, or one version of it, ``name@N`` (in
gateway mode ``tenant/name`` and ``tenant/name@N``). ``None`` (the default) lets a key use every
model of its tenant. Matching is by name only, never by what exists::

    entry "pirate"     allows  "pirate", "pirate@1", "pirate@2", ...   (every version)
    entry "pirate@2"   allows  "pirate@2" only                         (not "pirate")
    entry "<base>"     allows  the base model

A name the list does not allow is answered exactly like a model that does not exist (the same
404 ``model_not_found``, decided before anything is looked up), so a limited key learns nothing
about which other models its tenant has.
"""

from __future__ import annotations

from collections.abc import Iterable

from loraplex.platform.errors import APIError, clip

MAX_ALLOWED_MODELS = 64
MAX_MODEL_NAME = 140  # what a usage row's ``model`` holds


def allows(allowed: Iterable[str] | None, name: str) -> bool:
    """Whether an allowlist (None: no list) lets a key use the model ``name``."""
    if allowed is None:
        return True
    adapter, at, _ = name.partition("@")
    return any(entry == name or (at and entry == adapter) for entry in allowed)


def check_allowed_models(
    values: Iterable[object] | None, param: str = "allowed_models"
) -> list[str] | None:
    """An allowlist as stored: entries stripped, duplicates dropped, order kept; None stays
    None (every model). 400 for an empty list or a name that cannot name a model."""
    if values is None:
        return None
    if isinstance(values, str):  # one name where a list belongs
        values = [values]
    names: dict[str, None] = {}  # insertion-ordered set: each name checked once, in O(1)
    for value in values:
        name = value.strip() if isinstance(value, str) else None
        if not name or len(name) > MAX_MODEL_NAME or not name.isprintable() or " " in name:
            raise APIError(
                400,
                f"{param} takes model names (the base model's, an adapter's, or 'name@N'), each "
                f"1-{MAX_MODEL_NAME} characters without spaces; {clip(value, 40)} is not one.",
                param=param,
                code="invalid_allowed_models",
            )
        names[name] = None
        if len(names) > MAX_ALLOWED_MODELS:  # before reading the rest: the list is bounded
            raise APIError(
                400,
                f"{param} lists more than {MAX_ALLOWED_MODELS} models; at most "
                f"{MAX_ALLOWED_MODELS}. An adapter's name allows all its versions, so list "
                "names rather than each 'name@N'.",
                param=param,
                code="invalid_allowed_models",
            )
    if not names:
        raise APIError(
            400,
            f"{param} is empty, which would let the key use no model; list at least one model, "
            "or send null (leave it out) for every model of the tenant.",
            param=param,
            code="invalid_allowed_models",
        )
    return list(names)


def describe(allowed: Iterable[str] | None) -> str:
    """For tables: "all models", or the names joined by commas."""
    return "all models" if allowed is None else ", ".join(allowed)
