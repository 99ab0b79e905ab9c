"""The bound on characters per token that lets a prompt too long for the context be refused
without tokenizing it: exact for SmolLM2, sound (never refuses a prompt that fits) on adversarial
texts, and absent for tokenizers that drop text."""

from __future__ import annotations

import functools
import sys
import unicodedata
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.platform.openai.prompts import NFC_CHARS_PER_BYTE, TokenBound, token_bound
from tests.utils.app import make_app
from tests.utils.fakes import FakeEngineClient

LONGEST = "\n" + " " * 80  # SmolLM2's longest token: "ĊĠĠ...Ġ", 81 bytes
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<issue_comment>", "<jupyter_output>"]


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)


def _per_token(tokenizer: Any) -> float | None:
    bound = token_bound(tokenizer)
    return None if bound is None else bound.chars_per_token


def test_smollm2_bound_is_its_longest_token(smollm2: Any) -> None:
    assert _per_token(smollm2) == 81.0
    # and it is reached: the longest token repeated is one token per 81 characters
    assert _count(smollm2, LONGEST * 100) == 100


@pytest.mark.parametrize(
    "text",
    [
        LONGEST * 50 + "x",
        "#" * 5000,
        "-" * 5000 + " " + "=" * 5000,
        "".join(SPECIAL) * 200,  # special tokens written as text are one token each
        "<|im_start|>" * 500,
        "你好世界" * 500,  # 3-byte characters
        "😀🎉" * 500,  # 4-byte characters
        "e\u0301" * 1000,  # combining marks
        "\u00a0\u3000\t\r\n" * 500,
        "\x00\x01\x7f" * 500,
        " " * 10_000,
    ],
    ids=lambda text: ascii(text[:12]),
)
def test_bound_holds_on_adversarial_texts(smollm2: Any, text: str) -> None:
    bound = token_bound(smollm2)
    assert bound is not None
    assert bound.counted(text) == len(text)
    assert _count(smollm2, text) * bound.chars_per_token >= len(text)


def test_characters_the_vocabulary_lacks_are_not_counted(smollm2: Any) -> None:
    """SmolLM2 has no token for a few control bytes (and two lead bytes of unassigned planes):
    it drops them, so they cost no token and must not count against the context."""
    bound = token_bound(smollm2)
    assert bound is not None
    for char in ("\x04", "\x13", "\x1d", "\U00050000"):
        text = "hi" + char * 100
        assert bound.counted(text) == 2, repr(char)
    assert _count(smollm2, "\x04" * 1000) == 0
    assert bound.counted("\x05\x07 é 😀") == 6


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.text(min_size=1, max_size=40),
            st.sampled_from([*SPECIAL, LONGEST, "#" * 80, " " * 200, "\n\n\n", "ab"]),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_bound_holds_on_random_texts(smollm2: Any, parts: list[str]) -> None:
    text = "".join(parts)
    text = text.encode("utf-8", "replace").decode("utf-8")  # no lone surrogates (refused)
    bound = _smollm2_bound(smollm2)
    assert _count(smollm2, text) * bound.chars_per_token >= bound.counted(text)


@functools.cache
def _smollm2_bound(tokenizer: Any) -> TokenBound:
    bound = token_bound(tokenizer)
    assert bound is not None
    return bound


def test_nfc_ratio_over_every_code_point() -> None:
    """A character NFC composes came from at most len(NFD(c)) characters; 1.5 per byte at most."""
    worst = max(
        len(unicodedata.normalize("NFD", c)) / len(c.encode("utf-8"))
        for c in map(chr, range(sys.maxunicode + 1))
        if not 0xD800 <= ord(c) <= 0xDFFF
    )
    assert worst == NFC_CHARS_PER_BYTE


def _byte_level_tokenizer(**parts: Any) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["ĠĠ"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "Ġ")]))
    tok.pre_tokenizer = parts.get("pre", pre_tokenizers.ByteLevel(add_prefix_space=False))
    if "normalizer" in parts:
        tok.normalizer = parts["normalizer"]
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_bound_only_where_no_text_is_dropped(tokenizer: Any) -> None:
    from tokenizers import normalizers, pre_tokenizers

    # the tiny test tokenizer splits on whitespace and drops it: 10,000 spaces are 0 tokens
    assert _count(tokenizer, " " * 10_000) == 0
    assert _per_token(tokenizer) is None
    assert _per_token(_byte_level_tokenizer()) == 2.0
    nfc = _byte_level_tokenizer(normalizer=normalizers.NFC())
    assert _per_token(nfc) == 2.0 * NFC_CHARS_PER_BYTE
    assert _per_token(_byte_level_tokenizer(normalizer=normalizers.Lowercase())) is None
    assert _per_token(_byte_level_tokenizer(normalizer=normalizers.Strip())) is None
    dropping = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert _per_token(_byte_level_tokenizer(pre=dropping)) is None
    removing = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(" ", behavior="removed"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    assert _per_token(_byte_level_tokenizer(pre=removing)) is None


# ---- through the API: refused without tokenizing ---------------------------------------------


class SpyTokenizer:
    """The real tokenizer, recording the length of every text it tokenizes."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.tokenized: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.tokenized.append(len(text))
        return self._inner(text, **kwargs)


@pytest.fixture
def spy(smollm2: Any) -> SpyTokenizer:
    return SpyTokenizer(smollm2)


@pytest.fixture
def smol_fake(smollm2: Any) -> FakeEngineClient:
    return FakeEngineClient(model_dir=smollm2.name_or_path, max_model_len=1024, vocab_size=49152)


@pytest.fixture
async def smol_api(smol_fake: FakeEngineClient, spy: SpyTokenizer) -> AsyncIterator[Any]:
    app = make_app(smol_fake, spy, served_model_name="smol", max_request_bytes=4 * 1024 * 1024)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


@pytest.mark.anyio
async def test_prompt_over_the_bound_is_refused_untokenized(
    smol_api: httpx.AsyncClient, spy: SpyTokenizer, smol_fake: FakeEngineClient
) -> None:
    text = "hello " * (1024 * 81 // 6 + 1)  # 1024 tokens of 81 characters would not hold it
    for path, body, param in [
        ("/v1/completions", {"prompt": text}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", text]}, "prompt[1]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
    ]:
        r = await smol_api.post(path, json={"model": "smol", **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, "context_length_exceeded"), error
        assert "maximum context length is 1024 tokens" in error["message"], error
        assert "which take at least 1,02" in error["message"], error
        assert "stands for at most 81 characters" in error["message"], error
    assert all(n < 100 for n in spy.tokenized), spy.tokenized  # only "hi" was tokenized
    assert smol_fake.submitted == []


@pytest.mark.anyio
async def test_prompt_at_the_bound_that_fits_is_served(
    smol_api: httpx.AsyncClient, spy: SpyTokenizer, smol_fake: FakeEngineClient
) -> None:
    """The bound is tight and sound: 1,000 of the longest token (81,000 characters) fit."""
    r = await smol_api.post(
        "/v1/completions", json={"model": "smol", "prompt": LONGEST * 1000, "max_tokens": 1}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1000
    assert spy.tokenized == [81_000]


@pytest.mark.anyio
async def test_a_long_text_of_dropped_characters_is_not_refused(
    smol_api: httpx.AsyncClient, spy: SpyTokenizer
) -> None:
    """500,000 characters SmolLM2 drops, then a word: one token, served."""
    r = await smol_api.post(
        "/v1/completions",
        json={"model": "smol", "prompt": "\x04" * 500_000 + "hello", "max_tokens": 1},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1
