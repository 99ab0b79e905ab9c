"""The llguidance backend: constraints -> llguidance grammars -> ``LLMatcher``s.

Chosen over xgrammar by measurement on the project's CPU machine (``benchmarks/structured_backends.py``):
it compiles the schemas we serve faster, computes a mask in tens of microseconds, has no torch
dependency (an abi3 wheel), and refuses what it cannot enforce with a message naming the keyword.

A compiled grammar is one ``LLMatcher`` at its start state (the template); every request gets a
``deep_copy`` of it, which costs microseconds, so a schema is compiled once per engine.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance as llg
import numpy as np

from loraplex.grammar.base import GrammarError, GrammarMatcher, check_limits
from loraplex.grammar.memory import allocated_bytes
from loraplex.grammar.precheck import precheck
from loraplex.grammar.schema_check import locate_pattern
from loraplex.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from numpy.typing import NDArray

# Whitespace a JSON constraint allows between tokens: bounded, so a small model cannot loop on
# newlines until max_tokens (``disable_any_whitespace`` allows none).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
# Fraction digits a JSON number may have where its schema sets no ``multipleOf``: bounded for
# the same reason (a small model's "1.000000..." never ends); a schema this bound makes
# unsatisfiable (a range narrower than the step) is compiled without it.
JSON_FRACTION_DIGITS = 8
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})  # values, not subschemas

# llguidance's limits on one grammar, below its defaults where they let one request cost the
# process: the initial lexer fuel (default 1,000,000) let ((a{100}){100}){100} build 155 MB of
# lexer state at its first mask; 50,000 keeps that to 2 MB and still compiles a 73k-character
# form schema and the bench corpora (scripts in the commit message). Lexer states cost 1-2 kB
# each: 20,000 bounds what a grammar can grow to while it serves (default 250,000). Errors
# without the parser's state (verbose_errors): a message goes to a client.
INITIAL_LEXER_FUEL = 50_000
MAX_LEXER_STATES = 20_000
# A compiled grammar weighs at least this much in the byte-bounded caches, whatever the
# allocator says (``memory.allocated_bytes`` is process-wide: another thread may free meanwhile).
MIN_GRAMMAR_BYTES = 16 * 1024
BYTES_PER_GRAMMAR_CHAR = 16

_EXCERPT = re.compile(r"^\d+ \| ")
_REGEX_IN_AST = re.compile(r"\((?:Search)?Regex /(.*?)/\)")
_AST = re.compile(r":?\s*\((?:And|Or|Not|Concat|SearchRegex|Regex|Repeat) .*$", re.S)
_TOO_COMPLEX = (
    "too many expressions",
    "lexer precomputation failed",
    "initial lexer configuration",
    "Too many items",
    "fuel exhausted",
    "TooComplex",
    "grammar too large",
    "max_lexer_states",
)
_WHAT = {
    "json": "the JSON schema",
    "json_object": "the JSON object constraint",
    "regex": "the regex",
    "choice": "the choice list",
    "grammar": "the grammar",
}


def llg_tokenizer(
    tokenizer: Any, vocab_size: int | None = None, eos_token_ids: Sequence[int] | None = None
) -> llg.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (it walks the whole vocabulary: build
    it once). ``vocab_size``: the model's (rows of the logits; ids beyond the tokenizer's
    are never allowed); ``eos_token_ids``: what ends a generation (default: the tokenizer's)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise GrammarError(
            f"structured output needs a fast (Rust-backed) Hugging Face tokenizer; this model's "
            f"tokenizer is a {type(tokenizer).__name__}: save the model with a tokenizer.json"
        )
    rust = copy.copy(backend)  # padding and truncation off on a copy, as llguidance.hf does
    rust.no_padding()
    rust.no_truncation()
    eos: list[int] | int | None = list(eos_token_ids) if eos_token_ids else None
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    try:
        return llg.LLTokenizer(rust.to_str(), n_vocab=vocab_size, eos_token=eos)
    except Exception as exc:
        raise GrammarError(
            f"structured output cannot use this model's tokenizer: {type(exc).__name__}: {exc}"
        ) from exc


def bound_numbers(node: Any) -> Any:
    """A copy of the schema ``node`` in which every ``number`` without a ``multipleOf`` gets
    ``multipleOf: 1e-JSON_FRACTION_DIGITS``: the outputs allowed are a subset of the schema's."""
    if isinstance(node, list):
        return [bound_numbers(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA_KEYS else bound_numbers(v) for k, v in node.items()}
    kind = node.get("type")
    number = kind == "number" or (isinstance(kind, list) and "number" in kind)
    if number and "multipleOf" not in node:
        out["multipleOf"] = 10.0**-JSON_FRACTION_DIGITS
    return out


def grammar_text(constraint: StructuredOutputsParams, bounded: bool = True) -> str:
    """The llguidance grammar of ``constraint`` (not yet compiled: ``LLMatcher`` does that);
    ``bounded``: JSON numbers get at most ``JSON_FRACTION_DIGITS`` fraction digits."""
    kind = constraint.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else constraint.json
        if schema is True:
            schema = {}
        if schema is False:
            raise GrammarError(
                "the JSON schema is `false`, which no output satisfies; send a schema object"
            )
        if bounded:
            schema = bound_numbers(schema)
        options: JsonCompileOptions = (
            {"whitespace_flexible": False}
            if constraint.disable_any_whitespace
            else {"whitespace_pattern": JSON_WHITESPACE}
        )
        try:
            return str(llg.LLMatcher.grammar_from_json_schema(dict(schema), defaults=options))
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema cannot be read: {exc}") from exc
    if kind == "regex":
        assert constraint.regex is not None
        return str(llg.LLMatcher.grammar_from_regex(constraint.regex))
    if kind == "choice":
        options_lark = " | ".join(
            json.dumps(c, ensure_ascii=False) for c in constraint.choice or ()
        )
        return str(llg.LLMatcher.grammar_from_lark(f"start: {options_lark}"))
    assert constraint.grammar is not None
    try:  # Lark in llguidance's dialect, or GBNF (llama.cpp's EBNF), converted to Lark
        return str(llg.grammar_from("grammar", constraint.grammar))
    except ValueError as exc:
        raise GrammarError(f"the grammar cannot be read: {exc}") from exc


def parser_limits() -> llg.LLParserLimits:
    """The limits every grammar is compiled with (see ``INITIAL_LEXER_FUEL``)."""
    return llg.LLParserLimits(
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        max_lexer_states=MAX_LEXER_STATES,
        verbose_errors=False,
    )


def plain(why: str) -> str:
    """llguidance's message without its internals: the parser state it may append, and the
    regex syntax trees it quotes."""
    for mark in ("<state>", "<non-verbose/>"):
        why = why.split(mark, 1)[0]
    return _AST.sub("", why.strip()).strip()


def describe(constraint: StructuredOutputsParams, why: str) -> str:
    """A message for a person: what could not be enforced, llguidance's reason (which names the
    keyword, or the line and column) in plain words, and what to do."""
    what = _WHAT[constraint.kind]
    raw = why
    why = plain(why)
    if why.startswith("NoExtension"):
        named = what
        if constraint.kind == "regex" and constraint.regex is not None:
            named = f"the regex `{constraint.regex[:60]}`"
        return (
            f"{named} matches no output: nothing can be generated from its start; send a "
            f"{'regex' if constraint.kind == 'regex' else 'constraint'} that some text satisfies"
        )
    if any(mark in raw for mark in _TOO_COMPLEX):
        return (
            f"{what} is too complex to enforce within the server's limits on a grammar's "
            "size and lexer; simplify it (fewer or smaller counted repetitions, fewer "
            "alternatives that overlap) and send the request again"
        )
    if "Regex is empty" in raw or "determine if regex is empty" in raw:
        found = _REGEX_IN_AST.findall(raw)
        where = None
        if found and constraint.kind == "json":
            where = locate_pattern(constraint.json, found[0])
        at = f" (at {where})" if where else ""
        if "Unable" in raw:
            return (
                f"{what} makes one string match patterns{at} too complex to intersect; join "
                "them into one pattern and send the request again"
            )
        pattern = f" `{found[0][:60]}`" if found else ""
        return (
            f"{what} has a pattern{pattern}{at} that matches no string; fix it and send the "
            "request again"
        )
    # One line: llguidance's source excerpts ("   1 | start: ...") and carets only make sense
    # in a monospace block, the position ("at 1(8)") stays.
    lines = [ln.strip() for ln in why.splitlines()]
    why = " ".join(ln for ln in lines if ln and not set(ln) <= {"^"} and not _EXCERPT.match(ln))
    if len(why) > 800:
        why = why[:800] + " ..."
    if "Unimplemented keys" in why:
        hint = "remove these keywords: structured output cannot enforce them"
    elif "Unknown format" in why:
        hint = (
            'use a supported "format" (date-time, date, time, duration, email, hostname, ipv4, '
            "ipv6, uuid, uri) or a pattern instead"
        )
    elif "Unsatisfiable" in why:
        hint = "no value satisfies it: loosen the bounds"
    else:
        hint = "fix it and send the request again"
    return f"{what} cannot be enforced: {why}; {hint}"


class LLGuidanceMatcher:
    """``GrammarMatcher`` over one ``LLMatcher``."""

    def __init__(self, matcher: llg.LLMatcher) -> None:
        self.llmatcher = matcher

    def fill_bitmask(self, bitmask: NDArray[np.int32], row: int) -> None:
        words = bitmask[row]
        if not words.flags["C_CONTIGUOUS"]:
            raise ValueError("bitmask rows must be C-contiguous")
        self.llmatcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.llmatcher.consume_token(token_id))

    def is_terminated(self) -> bool:
        m = self.llmatcher
        return bool(m.is_stopped()) and not m.is_error()

    def is_accepting(self) -> bool:
        return bool(self.llmatcher.is_accepting())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.llmatcher.rollback(num_tokens):
            raise GrammarError(
                f"the grammar matcher cannot roll back {num_tokens} tokens: "
                f"{plain(self.llmatcher.get_error()) or 'fewer were consumed'}"
            )

    def reset(self) -> None:
        self.llmatcher.reset()

    @property
    def error(self) -> str | None:
        m = self.llmatcher
        if not m.is_error():
            return None
        return plain(str(m.get_error())) or "the grammar matcher failed"


class LLGuidanceGrammar:
    """A compiled constraint: a template matcher at the start of the grammar, and what it weighs
    (``nbytes``: allocated over its compile and first mask, at least ``MIN_GRAMMAR_BYTES`` and
    ``BYTES_PER_GRAMMAR_CHAR`` a character of its grammar)."""

    def __init__(self, template: llg.LLMatcher, nbytes: int = MIN_GRAMMAR_BYTES) -> None:
        self._template = template
        self.nbytes = nbytes

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend:
    """``GrammarBackend`` on llguidance for one tokenizer."""

    name = "llguidance"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.tokenizer = llg_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = int(self.tokenizer.vocab_size)
        self._executor: llg.LLExecutor | None = None
        self._lock = threading.Lock()

    def compile(self, constraint: StructuredOutputsParams) -> LLGuidanceGrammar:
        """Bounded: the sizes (``check_limits``), the constructs no llguidance limit bounds
        (``precheck``), then llguidance under ``parser_limits``, and a first mask (a grammar
        that matches nothing fails there, not at a request's first step)."""
        check_limits(constraint)
        text = grammar_text(constraint)
        precheck(constraint, text if constraint.kind == "grammar" else None)
        before = allocated_bytes()
        # LLMatcher never raises for a bad grammar: it starts in an error state instead. It
        # releases the GIL while it builds the lexer (up to a second for huge schemas).
        template = llg.LLMatcher(self.tokenizer, text, log_level=0, limits=parser_limits())
        if template.is_error() and constraint.kind == "json":
            # the schema as it was sent: its own error, or a range the number bound emptied
            text = grammar_text(constraint, False)
            template = llg.LLMatcher(self.tokenizer, text, log_level=0, limits=parser_limits())
        why = str(template.get_error()) if template.is_error() else self._first_mask(template)
        if why:
            raise GrammarError(describe(constraint, why))
        after = allocated_bytes()
        kept = after - before if before is not None and after is not None else 0
        floor = MIN_GRAMMAR_BYTES + BYTES_PER_GRAMMAR_CHAR * len(text)
        return LLGuidanceGrammar(template, max(kept, floor))

    def _first_mask(self, template: llg.LLMatcher) -> str:
        """llguidance's error at the grammar's first mask (computed on a copy), or ""."""
        probe = template.deep_copy()
        words = np.zeros(-(-self.vocab_size // 32), dtype=np.int32)
        probe.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if probe.is_error():
            return str(probe.get_error())
        return "" if words.any() else "NoExtension"

    def fill_bitmasks(
        self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: NDArray[np.int32]
    ) -> None:
        ours = [(m.llmatcher, row) for m, row in matchers if isinstance(m, LLGuidanceMatcher)]
        if len(ours) > 1 and bitmask.flags["C_CONTIGUOUS"]:
            # [rows, words] filled by llguidance's thread pool, the GIL released
            batch, words = bitmask.shape
            self._executor_().unsafe_compute_mask_ptr(ours, bitmask.ctypes.data, words * 4, batch)
            rest = [(m, row) for m, row in matchers if not isinstance(m, LLGuidanceMatcher)]
        else:
            rest = list(matchers)
        for m, row in rest:
            m.fill_bitmask(bitmask, row)

    def _executor_(self) -> llg.LLExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = llg.LLExecutor()
            return self._executor
