"""Malformed requests, byte by byte: each is a 4xx in OpenAI's envelope whose message says what
is wrong (and never repeats a huge value), or, for what OpenAI tolerates (unknown fields, a
``16.0`` where an integer goes), a normal answer. Never a 500.

``test_openai_errors.py`` holds the field-by-field checks; this file holds the bodies a fuzzer or a
careless client sends: broken JSON, wrong encodings and content types, absurd numbers, odd
nesting, unknown fields and roles (the bodies with one malformed field are in
``tests/utils/malformed.py``, shared with ``test_error_codes.py``)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.utils.errors import assert_error
from tests.utils.malformed import BAD_BODIES, CHAT, COMPLETION

pytestmark = pytest.mark.anyio

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
