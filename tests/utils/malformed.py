"""The malformed bodies a fuzzer or a careless client sends, one bad field each (wrong types,
unknown roles, absurd numbers, strings over their limits), with the field the error must name
and words its message must hold; ``test_malformed.py`` sends them, ``test_error_codes.py`` checks
their codes."""

from __future__ import annotations

from typing import Any

BASE = "tiny-chat"
USER = [{"role": "user", "content": "t30"}]
CHAT: dict[str, Any] = {"model": BASE, "messages": USER, "max_tokens": 2}
COMPLETION: dict[str, Any] = {"model": BASE, "prompt": "t30", "max_tokens": 2}

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
