"""Malformed requests, byte by byte: each is a 4xx in OpenAI's envelope whose message says what
is wrong (and never repeats a huge value), or, for what OpenAI tolerates (unknown fields, a
``16.0`` where an integer goes), a normal answer. Never a 500.

``test_openai_errors.py`` holds the field-by-field checks; this file holds the bodies a fuzzer or a
careless client sends: broken JSON, wrong encodings and content types, absurd numbers, odd
nesting, unknown fields and roles."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.platform.test_openai_errors import assert_error

pytestmark = pytest.mark.anyio

BASE = "tiny-chat"
USER = [{"role": "user", "content": "t30"}]
CHAT: dict[str, Any] = {"model": BASE, "messages": USER, "max_tokens": 2}
COMPLETION: dict[str, Any] = {"model": BASE, "prompt": "t30", "max_tokens": 2}
JSON = {"content-type": "application/json"}


async def post_raw(api: httpx.AsyncClient, path: str, content: bytes) -> httpx.Response:
    return await api.post(path, content=content, headers=JSON)


# (raw body, param, words the message must hold)
RAW_BODIES: list[tuple[bytes, str | None, str]] = [
    # invalid JSON: where, and why
    (b'{"model": "tiny-chat", "prompt": "t30",}', None, "not valid JSON at byte 39"),
    (b"{'model': 'tiny-chat'}", None, "double quotes"),
    (b'{"model": "tiny-chat" "prompt": "t30"}', None, "not valid JSON"),
    (b"", None, "no body"),
    (b"   ", None, "not valid JSON"),
    # valid JSON, but not an object
    (b'"hello"', None, "must be a JSON object"),
    (b"null", None, "must be a JSON object"),
    (b"[]", None, "must be a JSON object"),
    # bytes that are not UTF-8: in a value, in a key, an overlong encoding, a lone continuation
    (b'{"model": "tiny-chat", "prompt": "t30 \xc3\x28"}', None, "byte 38 is not valid UTF-8"),
    (b'{"model": "tiny-chat", "pr\xffompt": "t30"}', None, "byte 26 is not valid UTF-8"),
    (b'{"model": "tiny-chat", "prompt": "\xc0\xaf"}', None, "not valid UTF-8"),
    (b'{"model": "tiny-chat", "prompt": "\x80"}', None, "not valid UTF-8"),
    # numbers JSON allows but no field takes
    (b'{"model": "tiny-chat", "prompt": "t30", "max_tokens": 1' + b"0" * 5000 + b"}", None,
     "thousands of digits"),
    (b'{"model": "tiny-chat", "prompt": "t30", "temperature": 1e999}', "temperature", "finite"),
    (b'{"model": "tiny-chat", "prompt": "t30", "top_p": -Infinity}', "top_p", "finite"),
    # nesting deeper than the JSON parser goes
    (b'{"model": "tiny-chat", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None,
     "nests arrays or objects too deeply"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("content", "param", "words"), RAW_BODIES, ids=[words for _, _, words in RAW_BODIES]
)
async def test_undecodable_body_is_400(
    api: httpx.AsyncClient, content: bytes, param: str | None, words: str
) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        error = assert_error(await post_raw(api, path, content), 400, param)
        assert words in error["message"], error["message"]
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
async def test_json_without_a_json_content_type_is_400_naming_it(
    api: httpx.AsyncClient, content_type: str | None
) -> None:
    # curl -d sends application/x-www-form-urlencoded unless told otherwise
    headers = {"content-type": content_type} if content_type else {}
    r = await api.post("/v1/completions", content=json.dumps(COMPLETION), headers=headers)
    error = assert_error(r, 400, None)
    assert "Content-Type: application/json" in error["message"]
    assert "Content-Type is missing or not JSON" in error["message"]


# (path, body, param, words the message must hold)
BAD_BODIES: list[tuple[str, dict[str, Any], str | None, str]] = [
    # wrong types
    ("/v1/chat/completions", {**CHAT, "messages": None}, "messages", "valid list"),
    ("/v1/chat/completions", {**CHAT, "messages": [None]}, "messages[0]", "object"),
    ("/v1/chat/completions", {**CHAT, "messages": [["user", "t30"]]}, "messages[0]", "object"),
    ("/v1/chat/completions", {**CHAT, "model": 5}, "model", "string"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "16"}, "max_tokens", "integer"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 16.5}, "max_tokens", "integer"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "yes"}, "logprobs", "boolean"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": "t2"}, "stop_token_ids", "list"),
    ("/v1/completions", {**COMPLETION, "prompt": {"text": "t30"}}, "prompt", "a list of token"),
    ("/v1/completions", {**COMPLETION, "prompt": None}, "prompt", "a string"),
    ("/v1/completions", {**COMPLETION, "prompt": [True]}, "prompt", "a list of token ids"),
    # unknown roles
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "function", "content": "t30"}]},
     "messages[0].role", "'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "USER", "content": "t30"}]},
     "messages[0].role", "'user'"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": 5, "content": "t30"}]},
     "messages[0].role", "'user'"),
    ("/v1/chat/completions", {**CHAT, "messages": [*USER, {"content": "t31"}]},
     "messages[1].role", "required"),
    # empty messages and parts
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "at least one message"),
    ("/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "without its 'text'"),
    # negative, zero and huge max_tokens: the number shown by its size, not its 300 digits
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -(10**40)}, "max_tokens", "greater than"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens",
     "greater than or equal to 1"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 1e300}, "max_tokens",
     "you requested about 10^300 tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 10**200}, "max_tokens",
     "at most 63"),
    # prompts over the context length (64 tokens on the fake engine)
    ("/v1/completions", {**COMPLETION, "prompt": "t30 " * 64}, "prompt",
     "maximum context length is 64 tokens"),
    ("/v1/completions", {**COMPLETION, "prompt": ["t30", "t30 " * 100]}, "prompt",
     "your request has 100 tokens"),
    ("/v1/completions", {**COMPLETION, "prompt": list(range(3, 70))}, "prompt", "67 tokens"),
    ("/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "t30 " * 30}] * 3}, "messages",
     "in the messages"),
    # token ids no int64 holds: refused before the engine, without repeating them
    ("/v1/completions", {**COMPLETION, "prompt": [5, 10**40]}, "prompt[1]", "less than"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [-(10**40)]}, "stop_token_ids[0]",
     "greater than or equal to"),
    # n too large, in every shape
    ("/v1/chat/completions", {**CHAT, "n": 17}, "n", "more than the 16 samples"),
    ("/v1/chat/completions", {**CHAT, "n": 10**12}, "n", "n is 1000000000000"),
    ("/v1/chat/completions", {**CHAT, "n": 10**100}, "n", "n is about 10^100"),
    ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 1}, "best_of", "use n"),
    # strings over their limits
    ("/v1/completions", {**COMPLETION, "user": "u" * 300}, "user", "at most 256 characters"),
    ("/v1/completions", {**COMPLETION, "model": "m" * 300}, "model", "at most 256 characters"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    BAD_BODIES,
    ids=[f"{param}:{w}" for _, _, param, w in BAD_BODIES],
)
async def test_malformed_field_is_400_naming_it(
    api: httpx.AsyncClient, path: str, body: dict[str, Any], param: str | None, words: str
) -> None:
    r = await post_raw(api, path, json.dumps(body).encode())
    error = assert_error(r, 400, param)
    assert words in error["message"], error["message"]
    assert len(error["message"]) < 400, error["message"]  # no value is echoed at length


async def test_unknown_fields_are_ignored_as_openai_does(api: httpx.AsyncClient) -> None:
    extra = {"frobnicate": True, "metadata": {"a": [1, {"b": None}]}, "prompt_cache_key": "k"}
    chat = {
        **CHAT,
        **extra,
        "messages": [{"role": "user", "content": "t30", "audio": None, "refusal": "x"}],
        "stream_options": {"include_usage": False, "include_obfuscation": True},
    }
    r = await api.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == " t10 t11"
    r = await api.post("/v1/completions", json={**COMPLETION, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " t10 t11"


async def test_an_integral_float_is_an_integer(api: httpx.AsyncClient) -> None:
    """The OpenAPI schema says ``integer``, which in JSON Schema includes ``2.0``."""
    r = await api.post(
        "/v1/completions",
        json={**COMPLETION, "max_tokens": 3.0, "n": 2.0, "prompt": [30.0, 31], "seed": 7.0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 2 and body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 6,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_odd_but_valid_messages_are_answered(api: httpx.AsyncClient) -> None:
    for messages in (
        [{"role": "user", "content": ""}],  # empty content renders to the template's tokens
        [{"role": "user", "content": []}],
        [{"role": "user"}],  # content may be omitted (null), as for assistant turns
        [{"role": "developer", "content": "t30"}, {"role": "user", "content": "\u0000 é"}],
    ):
        r = await api.post("/v1/chat/completions", json={**CHAT, "messages": messages})
        assert r.status_code == 200, (messages, r.text)
