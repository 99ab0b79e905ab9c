"""Structured output's grammar layer, shared by the engine and the platform: constraints
(``StructuredOutputsParams``) compiled to grammars, and matchers that give each step's allowed
tokens. A leaf: it imports llguidance, numpy and ``loraplex.sampling_params``, nothing else of
loraplex, and no torch.

The platform calls ``check(constraint, tokenizer)`` (in a worker thread: a first compile can
take a while) before a request reaches the engine, and answers ``GrammarError`` with a 400. The
engine compiles again in its own process (``backend_for`` with the model's vocabulary and EOS
ids); both cache by ``constraint.key()``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

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
from loraplex.grammar.llg import LLGuidanceBackend
from loraplex.sampling_params import StructuredOutputsParams

__all__ = [
    "CACHE_SIZE",
    "MAX_CHOICES",
    "MAX_CHOICE_CHARS",
    "MAX_GRAMMAR_CHARS",
    "MAX_REGEX_CHARS",
    "MAX_SCHEMA_CHARS",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCache",
    "GrammarError",
    "GrammarMatcher",
    "LLGuidanceBackend",
    "backend_for",
    "check",
    "check_limits",
]

CACHE_SIZE = 256  # compiled constraints (and refusals) kept per backend, least recently used out


class GrammarCache:
    """``constraint.key()`` -> its compiled grammar, or the ``GrammarError`` it raised (a bad
    schema sent again is refused without compiling). LRU, thread-safe; two threads compiling
    the same key at once both compile (the second result wins; both are equal)."""

    def __init__(self, backend: GrammarBackend, size: int = CACHE_SIZE) -> None:
        self.backend = backend
        self.size = size
        self._items: OrderedDict[str, CompiledGrammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        key = constraint.key()
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
        if hit is None:
            try:
                hit = self.backend.compile(constraint)
            except GrammarError as exc:
                hit = exc
            with self._lock:
                self._items[key] = hit
                while len(self._items) > self.size:
                    self._items.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit


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
    (``MAX_SCHEMA_CHARS`` ...), and a grammar the backend compiles. ``GrammarError`` (a
    ``ValueError``) with a message for the client otherwise. Cached by ``constraint.key()``;
    a first compile may take up to about a second for huge schemas, so call it in a thread."""
    check_limits(constraint)
    backend_for(tokenizer).get(constraint)
