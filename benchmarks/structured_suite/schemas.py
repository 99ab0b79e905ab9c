"""The JSON-schema corpus of ``python -m benchmarks.structured_suite``: realistic schemas (extraction,
classification, forms), each with the user prompt that asks for it, a ``max_tokens`` and
hand-written instances that validate. The cases are data:
``benchmarks/corpora/structured_schemas.json``; this module loads them and says what they exercise.

Every schema is bounded: strings carry ``maxLength``, an anchored ``pattern``, an ``enum`` or a
``const``; arrays carry ``maxItems``; objects are closed (``additionalProperties: false``). So
``longest_output`` can say how many characters the longest compact instance has, and a case's
``max_tokens`` covers it at one token per character (a token is at least one character). Numbers
count ``NUMBER_CHARS`` and free whitespace between JSON tokens is not counted: both are bounded
by the engine (fraction digits, whitespace runs) and are paid from the slack, since real text
runs several characters to a token.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Schema = dict[str, Any]
# The regex parser (``re._parser`` from 3.11, ``sre_parse`` before): getwidth() bounds a pattern.
_parser: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")
NUMBER_CHARS = 24  # a JSON number without digit bounds: sign, digits, fraction, exponent


@dataclass(frozen=True)
class SchemaCase:
    name: str
    prompt: str
    schema: Schema
    examples: tuple[Any, ...]  # instances written by hand; each validates against the schema
    max_tokens: int = 256


# ---- schema builders (plain dicts; they only shorten the corpus) ------------------------------


def text(max_length: int, min_length: int = 1) -> Schema:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def pattern(regex: str) -> Schema:
    return {"type": "string", "pattern": regex}


def integer(minimum: int, maximum: int) -> Schema:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def number(minimum: float, maximum: float) -> Schema:
    return {"type": "number", "minimum": minimum, "maximum": maximum}


def enum(*values: Any) -> Schema:
    return {"type": "string", "enum": list(values)}


def array(items: Schema, min_items: int, max_items: int) -> Schema:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def obj(properties: Mapping[str, Schema], optional: Mapping[str, Schema] | None = None) -> Schema:
    """A closed object: ``properties`` required, ``optional`` not."""
    return {
        "type": "object",
        "properties": {**properties, **(optional or {})},
        "required": list(properties),
        "additionalProperties": False,
    }


DATE = r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"
EMAIL = r"^[a-z0-9._]{1,20}@[a-z0-9]{1,15}\.[a-z]{2,4}$"


# ---- what a schema exercises, and its longest output -------------------------------------------

FEATURES = (
    "nested",  # an object inside an object (or inside an array)
    "enum",
    "array_bounds",  # minItems / maxItems
    "number_range",  # minimum / maximum on a number or an integer
    "pattern",
    "lengths",  # minLength / maxLength
    "anyOf",
    "nullable",  # a type list with "null", or anyOf with {"type": "null"}
    "ref",  # $ref into $defs
    "required",
    "closed",  # additionalProperties: false
)


def features(schema: Schema) -> set[str]:
    """The keywords of ``FEATURES`` that ``schema`` (with its ``$defs``) uses."""
    found: set[str] = set()

    def walk(s: Any, inside_object: bool) -> None:
        if not isinstance(s, dict):
            return
        types = s.get("type")
        types = types if isinstance(types, list) else [types]
        if inside_object and ("object" in types or "$ref" in s):
            found.add("nested")
        checks = {
            "enum": "enum" in s,
            "array_bounds": "minItems" in s or "maxItems" in s,
            "number_range": bool({"minimum", "maximum"} & s.keys()),
            "pattern": "pattern" in s,
            "lengths": "minLength" in s or "maxLength" in s,
            "anyOf": "anyOf" in s,
            "nullable": "null" in types or any(b.get("type") == "null" for b in s.get("anyOf", ())),
            "ref": "$ref" in s,
            "required": bool(s.get("required")),
            "closed": s.get("additionalProperties") is False,
        }
        found.update(k for k, v in checks.items() if v)
        here = inside_object or "object" in types or "array" in types
        for child in s.get("properties", {}).values():
            walk(child, True)
        for key in ("items", "$defs"):
            value = s.get(key)
            for child in value.values() if key == "$defs" and value else [value]:
                walk(child, here if key == "items" else False)
        for branch in s.get("anyOf", ()):
            walk(branch, inside_object)

    walk(schema, False)
    return found


class UnboundedSchema(ValueError):
    """A schema whose output has no length bound (a string or array without one)."""


def longest_output(schema: Schema) -> int:
    """The characters of the longest compact JSON instance of ``schema`` (every optional
    property present); ``UnboundedSchema`` where a string or an array has no bound."""
    defs = schema.get("$defs", {})

    def size(s: Schema, where: str) -> int:
        if "$ref" in s:
            return size(defs[s["$ref"].removeprefix("#/$defs/")], s["$ref"])
        if "const" in s:
            return len(json.dumps(s["const"]))
        if "enum" in s:
            return max(len(json.dumps(v)) for v in s["enum"])
        if "anyOf" in s:
            return max(size(b, where) for b in s["anyOf"])
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        return max(scalar(s, t, where) for t in types)

    def scalar(s: Schema, t: str, where: str) -> int:
        if t == "string":
            if "maxLength" in s:
                return int(s["maxLength"]) + 2
            if "pattern" in s:
                width = _parser.parse(s["pattern"]).getwidth()[1]
                if width < 10_000:
                    return int(width) + 2
            raise UnboundedSchema(f"{where}: a string without maxLength or a bounded pattern")
        if t == "integer":
            return max(len(str(int(s.get(k, 10**18)))) for k in ("minimum", "maximum"))
        if t == "number":
            return NUMBER_CHARS
        if t == "boolean":
            return 5
        if t == "null":
            return 4
        if t == "array":
            if "maxItems" not in s:
                raise UnboundedSchema(f"{where}: an array without maxItems")
            n = int(s["maxItems"])
            return 2 + n * size(s["items"], f"{where}[]") + max(n - 1, 0)
        if t == "object":
            props = s.get("properties", {})
            if s.get("additionalProperties") is not False:
                raise UnboundedSchema(f"{where}: an object open to more properties")
            parts = [len(json.dumps(k)) + 1 + size(v, f"{where}.{k}") for k, v in props.items()]
            return 2 + sum(parts) + max(len(parts) - 1, 0)
        raise UnboundedSchema(f"{where}: type {t!r}")

    return size(schema, "$")


# ---- the corpus: benchmarks/corpora/structured_schemas.json ------------------------------------

CORPUS = Path(__file__).resolve().parents[1] / "corpora" / "structured_schemas.json"


def load_cases(path: Path = CORPUS) -> tuple[SchemaCase, ...]:
    """The corpus: a JSON list of ``{name, prompt, max_tokens, schema, examples}``."""
    return tuple(
        SchemaCase(c["name"], c["prompt"], c["schema"], tuple(c["examples"]), c["max_tokens"])
        for c in json.loads(path.read_text(encoding="utf-8"))
    )


SCHEMA_CASES: tuple[SchemaCase, ...] = load_cases()
