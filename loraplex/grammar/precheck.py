"""Refusals before compiling: the constructs that cost llguidance time or memory no limit of its
own bounds, or that it only reports mid-generation, each named where the request wrote it.

* counted repetitions: one count above ``MAX_REPEAT`` (``a{1000000}``), nested counts whose
  product is above it (``((a{100}){100}){100}``), or above ``MAX_NESTED_RANGE`` when an inner
  count is a range (``([a-z]{1,50}){1,50}``) -- in a regex, a schema's ``pattern`` or
  ``patternProperties``, a grammar's ``/regex/`` tokens and its counted items;
* more than ``MAX_PATTERNS_AT_ONCE`` patterns one string must match together (``allOf``);
* a schema or a start rule no finite output satisfies (``$ref`` cycles, ``start: start``);
* ``x-guidance`` in a schema: llguidance's compile options, which would undo the server's
  (``lenient`` ignores keywords the server refuses, ``whitespace_pattern`` allows the unbounded
  whitespace the server bounds). In a grammar's ``%json``, ``lenient``.

Each is a ``GrammarError`` whose message names the regex, the schema path or the rule, and says
what to send instead. Pure Python over the request's text: microseconds to a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.grammar.base import GrammarError
from loraplex.grammar.lark_check import json_body, read_lark
from loraplex.grammar.regex_cost import regex_cost
from loraplex.grammar.schema_check import Schema
from loraplex.sampling_params import StructuredOutputsParams

MAX_REPEAT = 10_000  # a counted repetition, or nested counts multiplied together
MAX_NESTED_RANGE = 1_000  # nested counts multiplied, when an inner one is a range
# Regexes one string must match together: llguidance's check of their intersection grows
# exponentially with their count (schema_check.py; figures in docs/benchmarks.md).
MAX_PATTERNS_AT_ONCE = 8
# in a grammar's %json: lenient ignores the keywords the server refuses as unenforceable (a
# grammar's own whitespace is its author's to choose: its Lark can allow any)
_REFUSED_GUIDANCE = ("lenient",)


def precheck(constraint: StructuredOutputsParams, grammar_text: str | None = None) -> None:
    """``GrammarError`` naming the first construct of ``constraint`` listed in the module's
    docstring. ``grammar_text``: a ``grammar`` constraint as Lark (GBNF converted)."""
    kind = constraint.kind
    if kind == "json" and isinstance(constraint.json, Mapping):
        check_schema(constraint.json, "the JSON schema", guidance=False)
    elif kind == "regex":
        assert constraint.regex is not None
        check_regex(constraint.regex, "the regex")
    elif kind == "grammar":
        check_grammar(grammar_text if grammar_text is not None else constraint.grammar or "")


def check_regex(pattern: str, what: str) -> None:
    """``what``: how the message names the regex ("the regex", "the pattern at /a/pattern")."""
    cost = regex_cost(pattern)
    if cost.largest.product > MAX_REPEAT:
        part = _quote(pattern[cost.largest.start : cost.largest.end])
        raise GrammarError(
            f"{what} repeats {part} {cost.largest.product:,} times; at most {MAX_REPEAT:,} "
            "repetitions of one part can be enforced (each is built into the matcher): use a "
            "smaller count, or an unbounded repetition (+ or *) and max_tokens"
        )
    for nest, limit in ((cost.nested, MAX_REPEAT), (cost.nested_ranged, MAX_NESTED_RANGE)):
        if nest.product > limit:
            part = _quote(pattern[nest.start : nest.end])
            ranged = " with a range inside" if limit == MAX_NESTED_RANGE else ""
            raise GrammarError(
                f"{what} nests counted repetitions{ranged}: {part} repeats its innermost part "
                f"{nest.product:,} times in all (nested counts multiply); at most {limit:,} can "
                "be enforced: write the repetition without nesting, or with smaller counts"
            )


def check_schema(schema: Mapping[str, Any], what: str, *, guidance: bool) -> None:
    """``guidance``: ``x-guidance`` is allowed except ``_REFUSED_GUIDANCE`` (a grammar's
    ``%json``, where the tool-call grammars set their separators), else refused."""
    s = Schema(schema)
    for path, node in s.nodes.items():
        options = node.get("x-guidance")
        if options is not None and not guidance:
            raise GrammarError(
                f"{what} sets x-guidance at {_at(path)}: the grammar library's compile options "
                "are the server's to set (they would let keywords it refuses through, or allow "
                "unbounded whitespace); remove it. For compact JSON, send "
                "disable_any_whitespace: true"
            )
        if isinstance(options, Mapping) and any(options.get(k) for k in _REFUSED_GUIDANCE):
            raise GrammarError(
                f"{what} sets x-guidance.lenient at {_at(path)}: it would ignore the keywords "
                "that cannot be enforced instead of refusing them; remove it"
            )
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            check_regex(pattern, f"{what}'s pattern at {path}/pattern")
        props = node.get("patternProperties")
        if isinstance(props, Mapping):
            for key in props:
                check_regex(
                    str(key), f"{what}'s patternProperties key {_quote(str(key))} at {path}"
                )
    for path in s.nodes:
        count = s.intersected(path)
        if count > MAX_PATTERNS_AT_ONCE:
            raise GrammarError(
                f"{what} makes a string at {_at(path)} match {count} patterns at once "
                f"(pattern and format, with those of its allOf and $ref); at most "
                f"{MAX_PATTERNS_AT_ONCE} can be intersected: join them into fewer patterns"
            )
    cycle = s.never_ending()
    if cycle is not None:
        steps = " -> ".join(f"#{p}" for p in cycle)
        raise GrammarError(
            f"{what} has no finite value: {steps} need each other with nothing in between "
            "(a $ref cycle, or a required property that needs its own object again); give the "
            "cycle a way out, such as an anyOf branch without the reference or an optional "
            "property"
        )


def check_grammar(text: str) -> None:
    """A Lark grammar's start rule, counts, regex tokens and ``%json`` schemas."""
    lark = read_lark(text)
    if lark is None:
        return  # a grammar this reader does not follow: llguidance judges it alone
    if "start" in lark.rules and "start" in lark.never_ending():
        stuck = ", ".join(lark.never_ending())
        raise GrammarError(
            "the grammar's rule start never ends: each of its alternatives needs a rule that "
            f"never ends (rules with no finite text: {stuck}), so no output completes it; give "
            'the recursion a way out, e.g. start: "a" start | "a"'
        )
    for rule, pattern in lark.regexes():
        check_regex(pattern, f"the grammar's regex /{_clip(pattern)}/ in rule {rule}")
    over = lark.repeats(_regex_product, MAX_REPEAT)
    if over is not None:
        product, rule = over
        raise GrammarError(
            f"the grammar's rule {rule} repeats its innermost part {product:,} times in all "
            f"(nested counts and rules multiply); at most {MAX_REPEAT:,} can be enforced: use "
            "smaller counts, or an unbounded repetition (+ or *)"
        )
    for rule, body in lark.schemas():
        try:
            schema = json_body(body)
        except ValueError:
            continue  # llguidance says what is wrong with it
        if isinstance(schema, Mapping):
            check_schema(schema, f"the %json schema in rule {rule}", guidance=True)


def _at(path: str) -> str:
    return path or "the root"


def _regex_product(pattern: str) -> int:
    cost = regex_cost(pattern)
    return max(cost.largest.product, cost.nested.product)


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _quote(text: str) -> str:
    return f"`{_clip(text)}`"
