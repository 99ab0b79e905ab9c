"""How ``python -m benchmarks.structured_suite`` judges an output, with no server: JSON against a schema
(Draft 2020-12), a regex in full, a choice, tool calls against their tools' parameter schemas,
and the per-kind totals of a run. Each check returns ``None`` when the output is valid, else
one line saying what is wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from benchmarks.structured_suite.constraints import TOOLS, RefusalCase, ToolCase


def check_json(text: str, schema: Mapping[str, Any]) -> str | None:
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    error = best_match(Draft202012Validator(schema).iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"schema: at {where}: {error.message}"


def check_pattern(text: str, pattern: str) -> str | None:
    return None if re.fullmatch(pattern, text) else f"does not match {pattern!r} in full"


def check_choice(text: str, choices: Sequence[str]) -> str | None:
    return None if text in choices else f"{text!r} is not one of {list(choices)}"


def check_finish(finish_reason: str | None) -> str | None:
    if finish_reason == "length":
        return "stopped at max_tokens (finish_reason length)"
    return None


def check_refusal(status: int, error: Any, case: RefusalCase) -> str | None:
    """A 400 in OpenAI's error shape (``error`` is its ``error`` object) whose message names
    what was wrong (every one of ``case.mentions``)."""
    if status != 400:
        return f"HTTP {status}, expected 400"
    if not isinstance(error, Mapping) or not isinstance(error.get("message"), str):
        return f"not OpenAI's error shape: {str(error)[:200]}"
    missing = [m for m in case.mentions if m not in error["message"]]
    if missing:
        return f"the message does not name {missing}: {error['message'][:300]}"
    return None


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the API sends it


def check_tool_calls(calls: Sequence[ToolCall], case: ToolCase) -> str | None:
    """Every call names one of the case's tools (the named one where ``tool_choice`` names one),
    has an id, and its arguments validate against that tool's parameters; at least one call,
    exactly one where ``parallel_tool_calls`` is false."""
    if not calls:
        return "no tool call"
    if case.parallel_tool_calls is False and len(calls) > 1:
        return f"{len(calls)} tool calls with parallel_tool_calls false"
    allowed = case.tools if case.tool_choice == "required" else (case.tool_choice,)
    for i, call in enumerate(calls):
        if not call.id:
            return f"call {i}: no id"
        if call.name not in allowed:
            return f"call {i}: function {call.name!r}, expected one of {list(allowed)}"
        error = check_json(call.arguments, TOOLS[call.name]["function"]["parameters"])
        if error:
            return f"call {i} ({call.name}): arguments {error}"
    return None


class ToolCallAssembler:
    """Joins streamed ``tool_calls`` deltas (dicts as ``model_dump`` gives them): the first
    delta of an index carries its id and name, the rest carry pieces of the arguments."""

    def __init__(self) -> None:
        self._parts: dict[int, dict[str, str]] = {}

    def add(self, deltas: Iterable[Mapping[str, Any]]) -> None:
        for delta in deltas:
            part = self._parts.setdefault(int(delta.get("index") or 0), {})
            if delta.get("id"):
                part["id"] = str(delta["id"])
            function = delta.get("function") or {}
            if function.get("name"):
                part["name"] = part.get("name", "") + str(function["name"])
            if function.get("arguments"):
                part["arguments"] = part.get("arguments", "") + str(function["arguments"])

    def calls(self) -> list[ToolCall]:
        return [
            ToolCall(p.get("id", ""), p.get("name", ""), p.get("arguments", ""))
            for _, p in sorted(self._parts.items())
        ]


# ---- a run's outcomes --------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    name: str
    model: str
    adapter: str | None  # None: the base model
    streamed: bool
    sampled: bool
    endpoint: str
    valid: bool = False
    finish_reason: str | None = None
    tokens: int | None = None
    seconds: float = 0.0
    error: str | None = None
    output: str = ""
    request: dict[str, Any] | None = field(default=None)  # kept for failed cases only


def totals(outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    """Per kind (and ``all``): n, valid, percent, and how many stopped at max_tokens."""
    kinds = sorted({o.kind for o in outcomes})
    out: dict[str, dict[str, Any]] = {}
    for kind in [*kinds, "all"]:
        group = [o for o in outcomes if kind in (o.kind, "all")]
        valid = sum(o.valid for o in group)
        out[kind] = {
            "n": len(group),
            "valid": valid,
            "percent": round(100.0 * valid / len(group), 1) if group else None,
            "length": sum(o.finish_reason == "length" for o in group),
            "adapter": sum(o.adapter is not None for o in group),
            "streamed": sum(o.streamed for o in group),
        }
    return out


def totals_table(summary: Mapping[str, Mapping[str, Any]]) -> str:
    rows = [
        f"{'kind':<12} {'n':>4} {'valid':>6} {'%':>6} {'length':>7} {'adapter':>8} {'stream':>7}"
    ]
    for kind, t in summary.items():
        rows.append(
            f"{kind:<12} {t['n']:>4} {t['valid']:>6} {t['percent']!s:>6} {t['length']:>7} "
            f"{t['adapter']:>8} {t['streamed']:>7}"
        )
    return "\n".join(rows)
