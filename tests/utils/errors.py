"""The bad requests of the OpenAI routes and how their errors are checked: ``assert_error`` (the
OpenAI envelope, the status, the field named), and ``BAD_BODIES``, one bad field each, with the
field the error must name and words its message must hold."""

from __future__ import annotations

from typing import Any

import httpx

BASE = "tiny-chat"
CHAT: dict[str, Any] = {"model": BASE, "messages": [{"role": "user", "content": "t30"}]}
COMPLETION: dict[str, Any] = {"model": BASE, "prompt": "t30"}


def assert_error(
    r: httpx.Response, status: int, param: str | None, code: str | None = None
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert len(error["message"]) > 20
    return error


# (path, body, param, words the message must hold)
BAD_BODIES: list[tuple[str, dict[str, Any], str | None, str]] = [
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "at least one message"),
    ("/v1/chat/completions", {"model": BASE}, "messages", "required"),
    ("/v1/chat/completions", {"messages": CHAT["messages"]}, "model", "required"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "wizard", "content": "t30"}]},
        "messages[0].role",
        "'user'",
    ),
    ("/v1/chat/completions", {**CHAT, "messages": "hello"}, "messages", "list"),
    ("/v1/chat/completions", {**CHAT, "n": 17}, "n", "16"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n", "greater than or equal to 1"),
    ("/v1/chat/completions", {**CHAT, "n": True}, "n", "integer"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, "max_tokens", "greater than"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2.5}, "max_tokens", "integer"),
    (
        "/v1/chat/completions",
        {**CHAT, "max_tokens": 10**30},
        "max_tokens",
        "maximum context length",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 61},
        "max_completion_tokens",
        "64 tokens",
    ),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature", "number"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature", "greater than"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p", "greater than 0"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 3}, "presence_penalty", "less than"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**70}, "seed", "less than"),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop", "non-empty"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a"] * 17}, "stop", "at most 16"),
    ("/v1/chat/completions", {**CHAT, "stop": 5}, "stop", "a string or a list of strings"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
        "list of content parts",
    ),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream", "boolean"),
    (
        "/v1/chat/completions",
        {**CHAT, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
        "boolean",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools[0].function.name",
        "letters, digits",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema"}},
        "response_format.json_schema",
        "needs its json_schema",
    ),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 10}}, "logit_bias", "not supported"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].type",
        "text parts",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "tool", "content": "t30"}]},
        "messages[0].tool_call_id",
        "without its tool_call_id",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "t30 " * 70}]},
        "messages",
        "maximum context length is 64 tokens",
    ),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt", "empty"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt", "empty"),
    ("/v1/completions", {**COMPLETION, "prompt": [5, 512]}, "prompt", "0..511"),
    ("/v1/completions", {**COMPLETION, "prompt": [5, -1]}, "prompt", "not a token id"),
    ("/v1/completions", {**COMPLETION, "prompt": [1.5]}, "prompt", "list of token ids"),
    (
        "/v1/completions",
        {**COMPLETION, "prompt": list(range(64))},
        "prompt",
        "maximum context length",
    ),
    ("/v1/completions", {**COMPLETION, "prompt": ["t30"] * 65}, "prompt", "split the batch"),
    (
        "/v1/completions",
        {**COMPLETION, "max_tokens": 64},
        "max_tokens",
        "set max_tokens to at most 63",
    ),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {**COMPLETION, "echo": True}, "echo", "not supported"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of", "use n"),
    ("/v1/completions", {**COMPLETION, "prompt": "\ud800"}, "prompt", "lone surrogate"),
    ("/v1/completions", {**COMPLETION, "stop": ["\udfff"]}, "stop[0]", "lone surrogate"),
]
