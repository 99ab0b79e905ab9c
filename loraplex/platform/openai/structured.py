"""Request fields that constrain the output -> one ``StructuredOutputsParams``, bounded and
compiled (off the event loop) before anything reaches the engine.

Where a request may say it (OpenAI's and vLLM's spellings)::

    response_format  {"type": "json_object"}
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs  {"json" | "regex" | "choice" | "grammar" | "json_object": ...,
                         "disable_any_whitespace": bool}                     (vLLM's)
    guided_json, guided_regex, guided_choice, guided_grammar              (vLLM's older names)
    tool_choice      "required" or a named function (tools.request builds that grammar)

A request may carry one constraint: two (``response_format`` and ``guided_regex``, or two keys of
``structured_outputs``) are a 400 naming both. Every size is bounded before any work (the schema's
bytes and nesting, the regex's and grammar's length, the number and length of choices; no
``x-guidance`` in a schema), and the constraint is compiled with the served tokenizer in a worker
thread (``ConstraintChecker``: the grammar layer's bounded compile, a verdict cached by the
constraint's key, threads shared fairly between tenants): a constraint that cannot be satisfied
or compiled within the bounds is a 400 ``invalid_constraint`` naming the field and the part of it
(the schema path, the regex, the rule), and the engine never sees it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from loraplex.grammar import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_CHARS,
    FairExecutor,
    GrammarBackend,
    GrammarError,
    LLGuidanceBackend,
    Verdicts,
)
from loraplex.grammar.precheck import check_schema as precheck_schema
from loraplex.platform.errors import APIError, invalid_request, shorten
from loraplex.platform.openai.protocol import SamplingFields
from loraplex.sampling_params import StructuredOutputsParams

# The grammar layer's limits (MAX_SCHEMA_CHARS of compact JSON, MAX_CHOICE_CHARS of all the
# choices together, ...), checked here first so each 400 names the request's field; and one of
# the platform's own: a schema's nesting, which the compiler would recurse through.
MAX_SCHEMA_DEPTH = 64  # nesting of objects and arrays in a schema
CHECK_THREADS = 2  # constraints compiled at once (worker threads)

# vLLM's structured_outputs keys: the constraints, then the options
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_OPTION_KEYS = ("disable_any_whitespace",)
_IGNORED_KEYS = ("disable_fallback",)  # asks for nothing here: there is no fallback backend
_REFUSED_KEYS = {
    "structural_tag": "structural tags are not supported",
    "whitespace_pattern": "a custom whitespace pattern is not supported; "
    "disable_any_whitespace: true gives compact JSON",
    "disable_additional_properties": "it is not supported; "
    'write "additionalProperties": false in the schema instead',
}
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class Constraint:
    """A request's constraint and the field that asked for it (``param`` of its errors)."""

    params: StructuredOutputsParams
    param: str
    subject: str | None = None  # what a compile error is about, when not params.kind's


def request_constraint(body: SamplingFields) -> Constraint | None:
    """The one constraint ``body`` asks for (None: none), every size checked; a 400 naming
    the field for anything malformed, too large, or asked twice."""
    found = _from_response_format(body) + _from_structured_outputs(body) + _from_guided(body)
    if len(found) > 1:
        first, second = found[0].param, found[1].param
        raise invalid_request(
            f"{first} and {second} both constrain the output, and a request takes one "
            f"constraint; send only one of them.",
            second,
            "conflicting_constraints",
        )
    return found[0] if found else None


def conflict_with_tools(constraint: Constraint, tool_choice: str) -> APIError:
    """``tool_choice``: how the message names it ("'required'", "a named function")."""
    return invalid_request(
        f"tool_choice {tool_choice} constrains the output to tool calls, and "
        f"{constraint.param} constrains it too; a request takes one constraint. Drop "
        f"{constraint.param}, or set tool_choice to 'auto'.",
        constraint.param,
        "conflicting_constraints",
    )


# ---- the fields ------------------------------------------------------------------------------


def _from_response_format(body: SamplingFields) -> list[Constraint]:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [Constraint(StructuredOutputsParams(json_object=True), "response_format")]
    if fmt.type == "json_schema":
        param = "response_format.json_schema"
        if fmt.json_schema is None:
            raise invalid_request(
                "response_format of type json_schema needs its json_schema: "
                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}.',
                param,
                "missing_schema",
            )
        schema = fmt.json_schema.schema_
        if schema is None:
            raise invalid_request(
                'response_format.json_schema has no "schema"; send the JSON schema the '
                'output must match, e.g. {"name": "answer", "schema": {"type": "object"}}.',
                param + ".schema",
                "missing_schema",
            )
        check_schema(schema, param + ".schema")
        return [Constraint(StructuredOutputsParams(json=schema), param + ".schema")]
    if fmt.type == "structural_tag":
        raise invalid_request(
            "response_format of type structural_tag is not supported by this server; use "
            "json_schema, or tools for function calls.",
            "response_format.type",
            "unsupported_parameter",
        )
    raise invalid_request(
        f"response_format.type is {shorten(fmt.type, 40)!r}; it must be 'text', 'json_object' "
        "or 'json_schema'.",
        "response_format.type",
        "invalid_value",
    )


def _from_structured_outputs(body: SamplingFields) -> list[Constraint]:
    raw = body.structured_outputs
    if raw is None:
        return []
    for key, value in raw.items():
        where = f"structured_outputs.{shorten(key, 40)}"
        if key in _REFUSED_KEYS and value not in (None, False):
            raise invalid_request(
                f"{where} is not supported by this server: {_REFUSED_KEYS[key]}. Remove it.",
                where,
                "unsupported_parameter",
            )
        if key not in (*_CONSTRAINT_KEYS, *_OPTION_KEYS, *_IGNORED_KEYS, *_REFUSED_KEYS):
            raise invalid_request(
                f"{where} is not a field of structured_outputs; it takes one of "
                f"{', '.join(_CONSTRAINT_KEYS)} (and disable_any_whitespace).",
                where,
                "invalid_value",
            )
    given = [k for k in _CONSTRAINT_KEYS if raw.get(k) not in (None, False)]
    if not given:
        raise invalid_request(
            "structured_outputs sets no constraint; give one of "
            f"{', '.join(_CONSTRAINT_KEYS)}, or drop structured_outputs.",
            "structured_outputs",
            "missing_constraint",
        )
    if len(given) > 1:
        raise invalid_request(
            f"structured_outputs.{given[0]} and structured_outputs.{given[1]} both constrain "
            "the output, and a request takes one constraint; send only one of them.",
            f"structured_outputs.{given[1]}",
            "conflicting_constraints",
        )
    key = given[0]
    compact = raw.get("disable_any_whitespace")
    if compact is not None and not isinstance(compact, bool):
        raise invalid_request(
            "structured_outputs.disable_any_whitespace must be true or false.",
            "structured_outputs.disable_any_whitespace",
            "invalid_type",
        )
    param = f"structured_outputs.{key}"
    return [Constraint(_constraint(key, raw[key], param, bool(compact)), param)]


def _from_guided(body: SamplingFields) -> list[Constraint]:
    out = []
    for name in _GUIDED:
        value = getattr(body, name)
        if value is not None:
            key = name.removeprefix("guided_")
            out.append(Constraint(_constraint(key, value, name, False), name))
    return out


def _constraint(key: str, value: Any, param: str, compact: bool) -> StructuredOutputsParams:
    """One constraint from a (possibly untyped) value, bounded; 400s name ``param``."""
    if key == "json":
        schema = _schema_value(value, param)
        return StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
    if key == "json_object":
        if value is not True:
            raise invalid_request(f"{param} must be true (any JSON object).", param, "invalid_type")
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
    if key == "regex":
        text = _text(value, param, MAX_REGEX_CHARS, "regular expression", "regex_too_long")
        return StructuredOutputsParams(regex=text, disable_any_whitespace=compact)
    if key == "grammar":
        text = _text(value, param, MAX_GRAMMAR_CHARS, "grammar", "grammar_too_long")
        return StructuredOutputsParams(grammar=text, disable_any_whitespace=compact)
    choices = _choices(value, param)
    return StructuredOutputsParams(choice=choices, disable_any_whitespace=compact)


def _schema_value(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        if len(value) > 4 * MAX_SCHEMA_CHARS:  # pretty-printed: compacted and counted below
            raise _schema_too_large(param, len(value))
        try:
            value = json.loads(value)
        except RecursionError:
            raise _too_deep(param) from None
        except ValueError as exc:
            raise invalid_request(
                f"{param} is a string that is not valid JSON ({shorten(str(exc), 120)}); send "
                "the JSON schema as an object.",
                param,
                "invalid_schema",
            ) from None
    if not isinstance(value, dict):
        raise invalid_request(
            f"{param} must be a JSON schema: an object such as "
            '{"type": "object", "properties": {...}}.',
            param,
            "invalid_schema",
        )
    check_schema(value, param)
    return value


def check_schema(schema: Mapping[str, Any], param: str) -> None:
    """400 when ``schema`` is longer than ``MAX_SCHEMA_CHARS`` as compact JSON, nested deeper
    than ``MAX_SCHEMA_DEPTH``, or holds a construct the grammar layer refuses before compiling
    (``x-guidance``, counted repetitions, too many patterns at once, a ``$ref`` cycle: see
    ``loraplex.grammar.precheck``), named by its path. Here, so a tool's schema is refused
    under its own field before the tools' grammar embeds it."""
    depth = _depth(schema)  # first: a deep value would overflow json.dumps' recursion
    if depth > MAX_SCHEMA_DEPTH:
        raise _too_deep(param)
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_CHARS:
        raise _schema_too_large(param, size)
    try:  # the constructs the grammar layer refuses before compiling, named by their path
        precheck_schema(schema, "the schema", guidance=False)
    except GrammarError as exc:
        raise invalid_request(
            f"{param}: {shorten(str(exc), 600)}.", param, "invalid_constraint"
        ) from None


def _too_deep(param: str) -> APIError:
    return invalid_request(
        f"{param} nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep; at most "
        f"{MAX_SCHEMA_DEPTH} are allowed. Flatten the schema (repeated parts can be $defs, "
        "referenced with $ref).",
        param,
        "schema_too_deep",
    )


def _schema_too_large(param: str, size: int) -> APIError:
    return invalid_request(
        f"{param} is {size:,} characters as compact JSON; at most {MAX_SCHEMA_CHARS:,} are "
        "allowed. Send a smaller schema (shorter descriptions, repeated parts in $defs).",
        param,
        "schema_too_large",
    )


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value (iterative: a deep value cannot overflow the stack)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item)
        if deepest > MAX_SCHEMA_DEPTH:
            break
    return deepest


def _text(value: Any, param: str, limit: int, what: str, code: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid_request(f"{param} must be a non-empty {what}.", param, "invalid_type")
    if len(value) > limit:
        raise invalid_request(
            f"{param} is {len(value):,} characters; at most {limit:,} are allowed. Send a "
            f"shorter {what}.",
            param,
            code,
        )
    return value


def _choices(value: Any, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or any(not isinstance(c, str) for c in value):
        raise invalid_request(
            f'{param} must be a non-empty list of strings, e.g. ["yes", "no"].',
            param,
            "invalid_type",
        )
    if len(value) > MAX_CHOICES:
        raise invalid_request(
            f"{param} holds {len(value):,} choices; at most {MAX_CHOICES:,} are allowed. Send "
            "fewer, or a regex or a JSON schema enum that describes them.",
            param,
            "too_many_choices",
        )
    total = sum(len(c) for c in value)
    if total > MAX_CHOICE_CHARS:
        raise invalid_request(
            f"{param} holds {total:,} characters in all; at most {MAX_CHOICE_CHARS:,} are "
            "allowed. Send shorter or fewer choices.",
            param,
            "choices_too_long",
        )
    return tuple(value)


# ---- compiling -------------------------------------------------------------------------------


class ConstraintChecker:
    """Compiles constraints with the served tokenizer on ``threads`` worker threads shared
    fairly between tenants (``FairExecutor``: one tenant's slow compiles queue behind its own),
    so that a constraint the grammar layer refuses is a 400 before the engine sees it, and a
    slow one never stalls the event loop. Keeps verdicts (``Verdicts``, bounded), never
    compiled grammars; a verdict already known answers without a thread.

    ``backend``: builds the grammar backend for a tokenizer (a test's hook: a held compile)."""

    def __init__(
        self,
        threads: int = CHECK_THREADS,
        backend: Callable[[Any], GrammarBackend] = LLGuidanceBackend,
    ) -> None:
        self._executor = FairExecutor(threads, "loraplex-check")
        self._backend = backend
        self._lock = threading.Lock()
        self._verdicts: tuple[Any, Verdicts] | None = None  # (the tokenizer, its verdicts)

    async def check(self, constraint: Constraint, tokenizer: Any, tenant: Hashable = None) -> None:
        """400 (``APIError``) when ``constraint`` cannot be enforced; ``tenant``: whose line
        the compile waits in."""
        verdicts = self._verdicts_now(tokenizer)
        known = verdicts.known(constraint.params) if verdicts is not None else None
        try:
            if known is None:
                job = self._executor.submit(tenant, self._check, constraint.params, tokenizer)
                await asyncio.wrap_future(job)
            elif known:
                raise GrammarError(known)
        except GrammarError as exc:
            raise grammar_error(constraint, str(exc)) from None

    def _verdicts_now(self, tokenizer: Any) -> Verdicts | None:
        with self._lock:
            if self._verdicts is not None and self._verdicts[0] is tokenizer:
                return self._verdicts[1]
        return None

    def _check(self, params: StructuredOutputsParams, tokenizer: Any) -> None:
        """On a worker thread: the verdicts of ``tokenizer`` (its backend built on first use:
        about half a second for a 50k vocabulary), then the check."""
        verdicts = self._verdicts_now(tokenizer)
        if verdicts is None:
            built = Verdicts(self._backend(tokenizer))
            with self._lock:
                if self._verdicts is None or self._verdicts[0] is not tokenizer:
                    self._verdicts = (tokenizer, built)
                verdicts = self._verdicts[1]
        verdicts.check(params)

    def shutdown(self) -> None:
        self._executor.shutdown(cancel=True)


def grammar_error(constraint: Constraint, reason: str) -> APIError:
    """The grammar layer's refusal (it names the keyword, the schema path, the regex or the
    rule, and what to do), as a 400 ``invalid_constraint`` naming the request's field. A
    grammar loraplex wrote (tool calls) is spoken of as its ``subject``."""
    if constraint.subject is not None and reason.startswith("the grammar"):
        reason = f"the {constraint.subject}" + reason.removeprefix("the grammar")
    reason = shorten(reason, 600)
    return invalid_request(
        f"{constraint.param}: {reason}{'' if reason.endswith('.') else '.'}",
        constraint.param,
        "invalid_constraint",
    )
