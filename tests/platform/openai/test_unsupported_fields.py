"""Fields of OpenAI's and vLLM's request schemas that would change the output and are not
implemented get a 400 naming them (``code: unsupported_parameter``) on both endpoints; their
harmless values (null, the default) and fields that change nothing are accepted."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loraplex.platform.openai.unsupported import IGNORED, UNSUPPORTED
from tests.utils.fakes import FakeEngineClient

pytestmark = pytest.mark.anyio

BASE = "tiny-chat"
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {"model": BASE, "messages": [{"role": "user", "content": "t30"}], "max_tokens": 2},
    ),
    "completions": ("/v1/completions", {"model": BASE, "prompt": "t30", "max_tokens": 2}),
}

# A value of each field that asks for what loraplex does not do. Kept apart from the table, so
# that a row added without a test here fails test_every_row_has_a_case.
REFUSED: dict[str, Any] = {
    "logit_bias": {"5": 10},
    "echo": True,
    "suffix": " the end",
    "best_of": 3,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "functions": [{"name": "f"}],
    "tool_choice": "required",
    "function_call": "auto",
    "parallel_tool_calls": False,
    "response_format": {"type": "json_object"},
    "stream_options": {"include_usage": True},
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "web_search_options": {},
    "reasoning_effort": "low",
    "verbosity": "low",
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "a"',
    "guided_whitespace_pattern": " ",
    "guided_decoding_backend": "xgrammar",
    "structural_tag": "{}",
    "structured_outputs": {"choice": ["yes", "no"]},
    "use_beam_search": True,
    "length_penalty": 0.5,
    "min_tokens": 4,
    "bad_words": ["t11"],
    "allowed_token_ids": [10, 11],
    "logits_processors": ["my.Processor"],
    "prompt_logprobs": 1,
    "truncate_prompt_tokens": 8,
    "spaces_between_special_tokens": False,
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "lora_request": {"lora_name": "x", "lora_int_id": 1, "lora_path": "/x"},
    "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"a": 1},
    "max_repetition_pattern_size": 4,
    "min_repetition_pattern_size": 2,
    "repetition_min_count": 3,
    "prompt_embeds": "AAAA",
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "documents": [{"title": "t", "text": "x"}],
    "mm_processor_kwargs": {"a": 1},
    "media_io_kwargs": {"a": 1},
    "include_reasoning": False,
}

# What the issue named, with the endpoints whose vLLM/OpenAI schema has the field: refused there
# whatever the table says.
CHAT_ONLY = {"tool_choice", "parallel_tool_calls"}
COMPLETIONS_ONLY = {"suffix"}
NAMED_IN_ISSUE = [
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "structured_outputs", "response_format", "tool_choice", "parallel_tool_calls",
    "stream_options", "prompt_logprobs", "logits_processors", "min_tokens", "bad_words",
    "truncate_prompt_tokens", "best_of", "echo", "suffix", "allowed_token_ids",
    "lora_request",
]  # fmt: skip
NAMED_CASES = [
    (endpoint, name)
    for name in NAMED_IN_ISSUE
    for endpoint in ("chat", "completions")
    if not (name in CHAT_ONLY and endpoint != "chat")
    and not (name in COMPLETIONS_ONLY and endpoint != "completions")
]

CASES = [
    (endpoint, name) for name, rule in UNSUPPORTED.items() for endpoint in sorted(rule.endpoints)
]


def test_every_row_has_a_case() -> None:
    assert set(REFUSED) == set(UNSUPPORTED)
    assert set(NAMED_IN_ISSUE) <= set(UNSUPPORTED)
    assert not IGNORED & set(UNSUPPORTED)


@pytest.mark.parametrize(("endpoint", "name"), CASES)
async def test_unsupported_field_is_400_naming_it(
    api: httpx.AsyncClient, fake: FakeEngineClient, endpoint: str, name: str
) -> None:
    path, body = BODIES[endpoint]
    r = await api.post(path, json={**body, name: REFUSED[name]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (name, "unsupported_parameter"), error
    assert f"'{name}' is not supported" in error["message"], error["message"]
    assert f"Remove '{name}'" in error["message"], error["message"]
    assert error["type"] == "invalid_request_error"
    assert fake.submitted == []  # refused before anything reached the engine


@pytest.mark.parametrize(("endpoint", "name"), NAMED_CASES)
async def test_fields_the_issue_names_are_refused(
    api: httpx.AsyncClient, endpoint: str, name: str
) -> None:
    path, body = BODIES[endpoint]
    r = await api.post(path, json={**body, name: REFUSED[name]})
    assert (r.status_code, r.json()["error"]["param"]) == (400, name), r.text


HARMLESS: list[tuple[str, Any]] = [
    ("echo", False),
    ("best_of", 1),
    ("logit_bias", {}),
    ("response_format", {"type": "text"}),
    ("stream_options", {"include_usage": False}),
    ("min_tokens", 0),
    ("bad_words", []),
    ("length_penalty", 1.0),
    ("length_penalty", 1),
    ("spaces_between_special_tokens", True),
    ("guided_json", None),
    ("lora_request", None),
]


@pytest.mark.parametrize(("name", "value"), HARMLESS)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_harmless_values_are_accepted(
    api: httpx.AsyncClient, endpoint: str, name: str, value: Any
) -> None:
    path, body = BODIES[endpoint]
    r = await api.post(path, json={**body, name: value})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_fields_that_change_nothing_are_ignored(
    api: httpx.AsyncClient, endpoint: str
) -> None:
    path, body = BODIES[endpoint]
    extra = {
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "user": "u1",
        "request_id": "abc",
        "frobnicate": 1,
    }
    r = await api.post(path, json={**body, **extra})
    assert r.status_code == 200, r.text


async def test_tool_choice_none_and_empty_tools_are_accepted(api: httpx.AsyncClient) -> None:
    path, body = BODIES["chat"]
    r = await api.post(path, json={**body, "tool_choice": "none", "tools": []})
    assert r.status_code == 200, r.text


async def test_stream_options_with_stream_is_accepted_but_continuous_stats_are_not(
    api: httpx.AsyncClient,
) -> None:
    path, body = BODIES["completions"]
    streamed = {**body, "stream": True}
    r = await api.post(path, json={**streamed, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    options = {"include_usage": True, "continuous_usage_stats": True}
    r = await api.post(path, json={**body, "stream_options": options})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "stream_options"), r.text


async def test_tool_calls_in_a_message_are_refused(api: httpx.AsyncClient) -> None:
    path, body = BODIES["chat"]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "t30"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "t31"},
    ]
    r = await api.post(path, json={**body, "messages": messages})
    error = r.json()["error"]
    assert (r.status_code, error["param"], error["code"]) == (
        400,
        "messages[1].tool_calls",
        "unsupported_parameter",
    ), r.text
