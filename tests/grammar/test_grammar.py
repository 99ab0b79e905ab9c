"""The grammar layer alone: ``check`` accepts what llguidance enforces and refuses the rest
with a message naming the keyword or limit; compiled grammars are cached by key; matchers give
masks that allow exactly the continuations of the grammar, EOS only where it accepts, and roll
back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loraplex.engine.records import token_bitmask
from loraplex.grammar import (
    MAX_CHOICES,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_CHARS,
    GrammarCache,
    GrammarError,
    LLGuidanceBackend,
    backend_for,
    check,
)
from loraplex.grammar.llg import JSON_FRACTION_DIGITS, bound_numbers
from loraplex.sampling_params import StructuredOutputsParams as SO
from tests.utils.structured import write_byte_tokenizer

VOCAB = 512
EOS = 1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path: Path = tmp_path_factory.mktemp("bytetok")
    write_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> LLGuidanceBackend:
    return LLGuidanceBackend(tokenizer, vocab_size=VOCAB, eos_token_ids=[EOS])


def allowed(matcher: Any, vocab: int = VOCAB) -> set[int]:
    mask = np.zeros((1, -(-vocab // 32)), dtype=np.int32)
    matcher.fill_bitmask(mask, 0)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
    return {int(t) for t in np.flatnonzero(bits)}


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "$defs": {"tag": {"enum": ["a", "b"]}},
}


@pytest.mark.parametrize(
    "constraint",
    [
        SO(json=PERSON),
        SO(json=json.dumps(PERSON)),
        SO(json_object=True),
        SO(json=True),
        SO(regex=r"\d{3}-[a-z]+"),
        SO(choice=["yes", "no", "über", "a\nb", 'say "hi"']),
        SO(grammar='start: "x" num\nnum: /[0-9]+/'),
        SO(grammar='start: "v=" obj\nobj: %json {"type": "integer"}'),
        SO(grammar='root ::= "yes" | "no"'),  # GBNF (llama.cpp's EBNF) is converted
        SO(json=PERSON, disable_any_whitespace=True),
    ],
    ids=lambda c: c.kind,
)
def test_check_accepts_what_the_backend_enforces(constraint: SO, tokenizer: Any) -> None:
    check(constraint, tokenizer)


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (SO(json={"type": "object", "not": {"required": ["a"]}}), ['"not"', "remove"]),
        (SO(json={"type": "array", "uniqueItems": True}), ['"uniqueItems"']),
        (SO(json={"type": "strnig"}), ["strnig"]),
        (SO(json={"type": "string", "format": "colour"}), ["colour", "format"]),
        (SO(json={"type": "integer", "minimum": 5, "maximum": 1}), ["minimum", "loosen"]),
        (SO(json={"$ref": "#/$defs/missing"}), ["/$defs/missing"]),
        (SO(json=False), ["`false`"]),
        (SO(regex="a(?=b)"), ["look-around", "regex"]),
        (SO(regex="[a-"), ["unclosed"]),
        (SO(grammar="start: foo"), ['"foo"', "1(8)"]),
        (SO(choice=[str(i) for i in range(MAX_CHOICES + 1)]), ["MAX_CHOICES"]),
        (SO(regex="a" * (MAX_REGEX_CHARS + 1)), ["MAX_REGEX_CHARS"]),
        (
            SO(json={"type": "object", "description": "x" * MAX_SCHEMA_CHARS}),
            ["MAX_SCHEMA_CHARS"],
        ),
    ],
)
def test_check_refuses_with_a_message_naming_the_problem(
    constraint: SO, words: list[str], tokenizer: Any
) -> None:
    with pytest.raises(GrammarError) as info:
        check(constraint, tokenizer)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in message, message
    assert "\n" not in message


def test_a_tokenizer_without_a_rust_backend_is_refused() -> None:
    with pytest.raises(GrammarError, match="fast"):
        check(SO(regex="a"), object())


class CountingBackend:
    name = "counting"
    vocab_size = VOCAB

    def __init__(self, inner: LLGuidanceBackend) -> None:
        self.inner = inner
        self.compiled: list[str] = []

    def compile(self, constraint: SO) -> Any:
        self.compiled.append(constraint.key())
        return self.inner.compile(constraint)

    def fill_bitmasks(self, matchers: Any, bitmask: Any) -> None:
        self.inner.fill_bitmasks(matchers, bitmask)


def test_the_cache_compiles_each_key_once_and_remembers_refusals(
    backend: LLGuidanceBackend,
) -> None:
    counting = CountingBackend(backend)
    cache = GrammarCache(counting, size=2)
    a, a_again = (
        SO(json={"type": "integer", "minimum": 1}),
        SO(json='{"minimum":1,"type":"integer"}'),
    )
    assert cache.get(a) is cache.get(a_again)  # equal constraints, one key
    for _ in range(2):
        with pytest.raises(GrammarError, match="look-around"):
            cache.get(SO(regex="a(?=b)"))
    assert len(counting.compiled) == 2
    cache.get(SO(regex="b"))  # a third key pushes the least recently used out
    cache.get(a)
    assert counting.compiled.count(a.key()) == 2


def test_backend_for_builds_one_backend_per_tokenizer(tokenizer: Any) -> None:
    assert backend_for(tokenizer) is backend_for(tokenizer)
    assert backend_for(tokenizer, VOCAB, [EOS]) is not backend_for(tokenizer)


def walk(backend: LLGuidanceBackend, tokenizer: Any, constraint: SO, text: str) -> Any:
    """Feed ``text`` token by token, checking each token is allowed and EOS is not, until the
    end; returns the matcher."""
    m = backend.compile(constraint).matcher()
    for tok in tokenizer(text).input_ids:
        mask = allowed(m)
        assert tok in mask, (text, tok)
        assert m.accept_token(tok)
    return m


def test_a_json_walk_allows_each_token_and_eos_only_at_the_end(
    backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    constraint = SO(json=PERSON)
    m = backend.compile(constraint).matcher()
    ids = tokenizer('{"name": "bo", "age": 12}').input_ids
    for tok in ids:
        mask = allowed(m)
        assert tok in mask and EOS not in mask
        assert not m.is_terminated()
        assert m.accept_token(tok)
    assert m.is_accepting() and m.is_terminated()
    assert allowed(m) == {EOS}
    assert all(t < len(tokenizer) for t in allowed(backend.compile(constraint).matcher()))

    m.rollback(2)  # back before `12}`
    assert not m.is_terminated()
    assert ids[-2] in allowed(m)
    m.reset()
    assert allowed(m) == allowed(backend.compile(constraint).matcher())


def test_a_refused_token_leaves_the_matcher_in_error(
    backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    m = backend.compile(SO(regex="[0-9]+")).matcher()
    assert m.error is None
    (a,) = tokenizer("a").input_ids
    assert a not in allowed(m)
    assert not m.accept_token(a)
    assert m.error and not m.is_terminated()


def test_a_number_may_stop_or_go_on(backend: LLGuidanceBackend, tokenizer: Any) -> None:
    m = walk(backend, tokenizer, SO(regex="[0-9]{1,3}"), "7")
    assert m.is_accepting() and not m.is_terminated()
    mask = allowed(m)
    assert EOS in mask and tokenizer("8").input_ids[0] in mask


def test_choices_match_exactly(backend: LLGuidanceBackend, tokenizer: Any) -> None:
    constraint = SO(choice=["über", 'say "hi"', "a\nb"])
    for text in constraint.choice or ():
        assert walk(backend, tokenizer, constraint, text).is_terminated()


def test_disable_any_whitespace_gives_compact_json(
    backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    m = backend.compile(SO(json=PERSON, disable_any_whitespace=True)).matcher()
    (space,) = tokenizer(" ").input_ids
    assert m.accept_token(tokenizer("{").input_ids[0])
    assert space not in allowed(m)
    loose = backend.compile(SO(json=PERSON)).matcher()
    assert loose.accept_token(tokenizer("{").input_ids[0])
    assert space in allowed(loose)


def test_parallel_fill_equals_one_by_one_and_the_engine_layout(
    backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    constraints = [SO(json=PERSON), SO(regex="[a-c]+"), SO(choice=["x", "yy"]), SO(json=PERSON)]
    matchers = [backend.compile(c).matcher() for c in constraints]
    matchers[3].accept_token(tokenizer("{").input_ids[0])
    words = -(-VOCAB // 32)
    together = np.zeros((6, words), dtype=np.int32)
    backend.fill_bitmasks([(m, 2 + i) for i, m in enumerate(matchers)], together)
    assert not together[:2].any()
    for i, m in enumerate(matchers):
        one = token_bitmask(allowed(m), VOCAB)
        assert np.array_equal(together[2 + i], one)


def test_json_numbers_have_bounded_fraction_digits(
    backend: LLGuidanceBackend, tokenizer: Any
) -> None:
    """A small model's "1.0000000..." must end: numbers without a multipleOf take at most
    JSON_FRACTION_DIGITS fraction digits (a subset of what the schema allows)."""
    schema = {"type": "object", "properties": {"p": {"type": "number"}}, "required": ["p"]}
    m = walk(backend, tokenizer, SO(json=schema), '{"p": 1.' + "0" * JSON_FRACTION_DIGITS)
    (zero,) = tokenizer("0").input_ids
    assert zero not in allowed(m)  # one more digit is refused; `}` is still allowed
    assert tokenizer("}").input_ids[0] in allowed(m)
    # The user's own multipleOf is kept; a range the bound would empty compiles unbounded.
    walk(backend, tokenizer, SO(json={"type": "number", "multipleOf": 0.5}), "2.5")
    tiny = {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-9}
    backend.compile(SO(json=tiny))
    assert bound_numbers({"enum": [{"type": "number"}], "type": ["number", "null"]}) == {
        "enum": [{"type": "number"}],
        "type": ["number", "null"],
        "multipleOf": 10.0**-JSON_FRACTION_DIGITS,
    }
