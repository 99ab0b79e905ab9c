"""What every grammar backend provides: a compiler from constraints to grammars, and matchers
that follow one generation token by token. Also the limits on constraint sizes, checked before
anything is compiled.

The engine sees only these protocols; ``llg.py`` implements them with llguidance. A second
backend (xgrammar, outlines) plugs in by implementing ``GrammarBackend`` for a tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from loraplex.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

# Bounds on what one request may ask for: compile time and memory grow with them, and a
# request over them is refused before it is compiled (the platform answers 400).
MAX_SCHEMA_CHARS = 64_000  # a JSON schema, as compact JSON text
MAX_GRAMMAR_CHARS = 64_000  # a Lark grammar
MAX_REGEX_CHARS = 4_000
MAX_CHOICES = 1_000
MAX_CHOICE_CHARS = 64_000  # all choices together


class GrammarError(ValueError):
    """A constraint the backend cannot compile or enforce. The message names the offending
    keyword or position and says how to fix it; the platform turns it into a 400."""


class GrammarMatcher(Protocol):
    """Follows one generation through a compiled grammar.

    Invariant: the matcher has consumed exactly the tokens generated so far (after a
    ``rollback(k)``, all but the last k). A refused token puts it in an error state it never
    leaves (``error``)."""

    def fill_bitmask(self, bitmask: NDArray[np.int32], row: int) -> None:
        """Write the tokens that may come next into ``bitmask[row]`` (int32 words, token ``t``
        allowed when bit ``t % 32`` of word ``t // 32`` is set; EOS only where the grammar
        accepts)."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Consume one sampled token; False when the grammar refuses it (``error`` says why)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more (only EOS)."""
        ...

    def is_accepting(self) -> bool:
        """The text so far is a complete match (it may stop here, or go on)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` consumed tokens."""
        ...

    def reset(self) -> None:
        """Back to the start, as a fresh matcher."""
        ...

    @property
    def error(self) -> str | None:
        """Why the matcher failed, or None while it is usable."""
        ...


class CompiledGrammar(Protocol):
    """One compiled constraint; cheap to start matchers from, shared by every request."""

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""
        ...


class GrammarBackend(Protocol):
    """A grammar library bound to one tokenizer (its vocabulary and EOS ids)."""

    name: str
    vocab_size: int  # bitmask rows hold ceil(vocab_size / 32) words

    def compile(self, constraint: StructuredOutputsParams) -> CompiledGrammar:
        """Compile ``constraint``; ``GrammarError`` when it cannot be enforced. Thread-safe,
        and may take long (call it off the engine step)."""
        ...

    def fill_bitmasks(
        self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: NDArray[np.int32]
    ) -> None:
        """``fill_bitmask`` for each (matcher, row) pair; may run them in parallel."""
        ...


def check_limits(constraint: StructuredOutputsParams) -> None:
    """``GrammarError`` naming the limit when ``constraint`` is larger than this module's
    bounds allow."""
    kind = constraint.kind
    if kind == "json":
        size = len(json.dumps(constraint.json, separators=(",", ":")))
        if size > MAX_SCHEMA_CHARS:
            raise GrammarError(
                f"the JSON schema is {size} characters long (as compact JSON); the limit is "
                f"{MAX_SCHEMA_CHARS} (MAX_SCHEMA_CHARS): send a smaller schema, e.g. move "
                "repeated parts into $defs and reference them"
            )
    elif kind == "grammar":
        assert constraint.grammar is not None
        if len(constraint.grammar) > MAX_GRAMMAR_CHARS:
            raise GrammarError(
                f"the grammar is {len(constraint.grammar)} characters long; the limit is "
                f"{MAX_GRAMMAR_CHARS} (MAX_GRAMMAR_CHARS): send a smaller grammar"
            )
    elif kind == "regex":
        assert constraint.regex is not None
        if len(constraint.regex) > MAX_REGEX_CHARS:
            raise GrammarError(
                f"the regex is {len(constraint.regex)} characters long; the limit is "
                f"{MAX_REGEX_CHARS} (MAX_REGEX_CHARS): send a shorter pattern"
            )
    elif kind == "choice":
        choices = constraint.choice or ()
        if len(choices) > MAX_CHOICES:
            raise GrammarError(
                f"choice lists {len(choices)} options; the limit is {MAX_CHOICES} "
                "(MAX_CHOICES): send fewer, or use a regex or a JSON schema enum"
            )
        total = sum(len(c) for c in choices)
        if total > MAX_CHOICE_CHARS:
            raise GrammarError(
                f"the choices hold {total} characters together; the limit is "
                f"{MAX_CHOICE_CHARS} (MAX_CHOICE_CHARS): send shorter or fewer options"
            )
