"""Structured output's grammar layer, shared by the engine and the platform: constraints
(``StructuredOutputsParams``) compiled to grammars, and matchers that give each step's allowed
tokens. A leaf: it imports llguidance, numpy and ``loraplex.sampling_params``, nothing else of
loraplex, and no torch.

Every compile is bounded: sizes (``check_limits``), the constructs no llguidance limit bounds
refused by name (``precheck``), llguidance's own limits (``llg.parser_limits``) and a first mask.
The platform checks a constraint (``Verdicts``, on ``FairExecutor`` threads) before a request
reaches the engine, and answers ``GrammarError`` with a 400; it keeps verdicts, never grammars.
The engine compiles again in its own process (its ``GrammarCache`` of compiled grammars, bounded
in entries and in bytes). Both cache by ``constraint.key()``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from loraplex.grammar import llg
from loraplex.grammar.base import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_CHARS,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    check_limits,
)
from loraplex.grammar.fair import FairExecutor
from loraplex.grammar.llg import LLGuidanceBackend
from loraplex.grammar.precheck import MAX_NESTED_RANGE, MAX_PATTERNS_AT_ONCE, MAX_REPEAT
from loraplex.sampling_params import StructuredOutputsParams

__all__ = [
    "CACHE_BYTES",
    "CACHE_SIZE",
    "MAX_CHOICES",
    "MAX_CHOICE_CHARS",
    "MAX_GRAMMAR_CHARS",
    "MAX_NESTED_RANGE",
    "MAX_PATTERNS_AT_ONCE",
    "MAX_REGEX_CHARS",
    "MAX_REPEAT",
    "MAX_SCHEMA_CHARS",
    "CompiledGrammar",
    "FairExecutor",
    "GrammarBackend",
    "GrammarCache",
    "GrammarError",
    "GrammarMatcher",
    "LLGuidanceBackend",
    "Verdicts",
    "backend_for",
    "check",
    "check_limits",
    "grammar_bytes",
]

CACHE_SIZE = 256  # compiled constraints (and refusals) kept per cache, least recently used out
# Bytes a cache's entries may weigh together (compiled grammars by ``grammar_bytes``, keys and
# refusals by their length): 100 grammars of ``a{10000}`` (4.4 MiB each) would take 440 MiB.
CACHE_BYTES = 128 * 1024 * 1024

V = TypeVar("V")


def grammar_bytes(grammar: CompiledGrammar) -> int:
    """What a compiled grammar weighs in a cache (its ``nbytes``; a backend that does not say
    is taken at ``llg.MIN_GRAMMAR_BYTES``)."""
    return int(getattr(grammar, "nbytes", 0)) or llg.MIN_GRAMMAR_BYTES


class BoundedLRU(Generic[V]):
    """key -> value, least recently used out past ``size`` entries or ``max_bytes`` (each entry
    weighs its key's length and the ``weight`` given with it). Not thread-safe."""

    def __init__(self, size: int = CACHE_SIZE, max_bytes: int = CACHE_BYTES) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self.nbytes = 0

    def get(self, key: str) -> V | None:
        hit = self._items.get(key)
        if hit is None:
            return None
        self._items.move_to_end(key)
        return hit[0]

    def put(self, key: str, value: V, weight: int) -> None:
        self.pop(key)
        weight += len(key)
        self._items[key] = (value, weight)
        self.nbytes += weight
        # the newest entry stays even when it alone is over max_bytes (it was just compiled)
        while len(self._items) > 1 and (
            len(self._items) > self.size or self.nbytes > self.max_bytes
        ):
            _, (_, w) = self._items.popitem(last=False)
            self.nbytes -= w

    def pop(self, key: str) -> V | None:
        hit = self._items.pop(key, None)
        if hit is None:
            return None
        self.nbytes -= hit[1]
        return hit[0]

    def __len__(self) -> int:
        return len(self._items)


class GrammarCache:
    """``constraint.key()`` -> its compiled grammar, or the ``GrammarError`` it raised (a bad
    schema sent again is refused without compiling). LRU bounded in entries and bytes,
    thread-safe; two threads compiling the same key at once both compile (the second result
    wins; both are equal)."""

    def __init__(
        self, backend: GrammarBackend, size: int = CACHE_SIZE, max_bytes: int = CACHE_BYTES
    ) -> None:
        self.backend = backend
        self._items: BoundedLRU[CompiledGrammar | GrammarError] = BoundedLRU(size, max_bytes)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._items.nbytes

    def get(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        key = constraint.key()
        with self._lock:
            hit = self._items.get(key)
        if hit is None:
            try:
                hit = self.backend.compile(constraint)
                weight = grammar_bytes(hit)
            except GrammarError as exc:
                hit, weight = exc, len(str(exc))
            with self._lock:
                self._items.put(key, hit, weight)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit


class Verdicts:
    """The platform's check: ``constraint.key()`` -> None (it compiles) or the refusal's
    message. It compiles with its backend and keeps only the verdict (the grammar is dropped:
    the engine compiles its own), bounded like ``GrammarCache``; thread-safe."""

    def __init__(
        self, backend: GrammarBackend, size: int = CACHE_SIZE, max_bytes: int = CACHE_BYTES
    ) -> None:
        self.backend = backend
        self._items: BoundedLRU[str] = BoundedLRU(size, max_bytes)
        self._lock = threading.Lock()

    def known(self, constraint: StructuredOutputsParams) -> str | None:
        """The cached verdict: "" (compiles), the refusal, or None (not checked yet)."""
        with self._lock:
            return self._items.get(constraint.key())

    def check(self, constraint: StructuredOutputsParams) -> None:
        """``GrammarError`` when ``constraint`` cannot be enforced (may compile: a thread)."""
        verdict = self.known(constraint)
        if verdict is None:
            check_limits(constraint)
            try:
                self.backend.compile(constraint)
                verdict = ""
            except GrammarError as exc:
                verdict = str(exc)
            with self._lock:
                self._items.put(constraint.key(), verdict, len(verdict))
        if verdict:
            raise GrammarError(verdict)


_lock = threading.Lock()
# (id(tokenizer), vocab_size, eos ids) -> (the tokenizer, kept alive so its id stays its own,
# and the cache of its backend)
_caches: dict[tuple[int, int | None, tuple[int, ...]], tuple[Any, GrammarCache]] = {}


def backend_for(
    tokenizer: Any, vocab_size: int | None = None, eos_token_ids: Sequence[int] | None = None
) -> GrammarCache:
    """The compile cache of the backend for ``tokenizer`` (built once per tokenizer, vocabulary
    size and EOS ids; ``GrammarError`` when the tokenizer cannot be used)."""
    key = (id(tokenizer), vocab_size, tuple(eos_token_ids or ()))
    with _lock:
        entry = _caches.get(key)
        if entry is not None:
            return entry[1]
    cache = GrammarCache(LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids))
    with _lock:
        entry = _caches.setdefault(key, (tokenizer, cache))
    return entry[1]


def check(constraint: StructuredOutputsParams, tokenizer: Any) -> None:
    """Validate ``constraint`` for ``tokenizer``'s model: sizes within the limits
    (``MAX_SCHEMA_CHARS`` ...), and a grammar the backend compiles within its bounds.
    ``GrammarError`` (a ``ValueError``) with a message for the client otherwise. Cached by
    ``constraint.key()``; a first compile may take up to about a second for huge schemas, so
    call it in a thread. (The platform's ``ConstraintChecker`` owns its own ``Verdicts``.)"""
    check_limits(constraint)
    backend_for(tokenizer).get(constraint)
