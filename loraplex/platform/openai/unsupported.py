"""Request fields of OpenAI's and vLLM's APIs that loraplex does not implement, as one table.

A client written for vLLM or OpenAI may send a field that changes the output (beam search, a
logit bias, structural tags, ...). Ignoring it would answer with unconstrained output and no warning, so
every such field is listed in ``UNSUPPORTED`` with what it would do: a request that sets one to
anything but a value that asks for nothing (null, or the field's default) gets a 400 naming it,
``code: "unsupported_parameter"``. Fields that change nothing in the output (``IGNORED``) and
unknown fields are ignored, as OpenAI does.

The table is the whole list: the README's list of unsupported fields is this table, and the
table-driven test walks every row on both endpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from loraplex.platform.errors import APIError, invalid_request

Endpoint = Literal["completions", "chat"]
BOTH: frozenset[Endpoint] = frozenset(("completions", "chat"))
CHAT: frozenset[Endpoint] = frozenset(("chat",))
COMPLETIONS: frozenset[Endpoint] = frozenset(("completions",))

# (value, request) -> True when the value asks for nothing loraplex lacks
Harmless = Callable[[Any, BaseModel], bool]


def default(*values: Any) -> Harmless:
    """Harmless: null or one of ``values`` (compared with their JSON type: ``0`` is not
    ``false``, ``1`` is not ``1.0``... but ``1.0`` from a float field is)."""

    def check(value: Any, _: BaseModel) -> bool:
        return value is None or any(_same(value, v) for v in values)

    return check


def _same(value: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(expected, bool) and value == expected
    if isinstance(expected, int | float):
        return isinstance(value, int | float) and value == expected
    return type(value) is type(expected) and value == expected


_NULL_ONLY = default()


def _best_of_is_n(value: Any, body: BaseModel) -> bool:
    return value is None or value == (getattr(body, "n", None) or 1)


def _stream_options(value: Any, body: BaseModel) -> bool:
    """Without ``stream``, options that ask for something (true) are refused, as OpenAI and vLLM
    do; ``{"include_usage": false}`` asks nothing."""
    if value is None or getattr(body, "stream", False):
        return True
    return not (value.include_usage or value.continuous_usage_stats)


@dataclass(frozen=True)
class Unsupported:
    why: str  # what the field does, which loraplex does not do (a clause after "it")
    harmless: Harmless = _NULL_ONLY
    endpoints: frozenset[Endpoint] = BOTH
    instead: str = ""  # what to do instead, when there is something


# Structured output is supported (structured.py: response_format, structured_outputs and the
# guided_* constraints; tools/ for tool calls); these fields ask for more of it than loraplex has.
_BACKENDS = ("auto", "guidance", "llguidance")  # vLLM's backend names that mean what runs here

UNSUPPORTED: dict[str, Unsupported] = {
    # ---- OpenAI's fields ----
    "logit_bias": Unsupported("biases chosen tokens", default({})),
    "echo": Unsupported(
        "returns the prompt with the completion", default(False), instead="prepend it yourself"
    ),
    "suffix": Unsupported("asks for text insertion", endpoints=COMPLETIONS),
    "best_of": Unsupported(
        "picks the best of several samples", _best_of_is_n, instead="use n to get several"
    ),
    "functions": Unsupported(
        "is OpenAI's deprecated function calling", default([]), CHAT, instead="use tools"
    ),
    "function_call": Unsupported(
        "is OpenAI's deprecated function calling",
        default("none"),
        CHAT,
        instead="use tool_choice",
    ),
    "stream_options": Unsupported(
        "applies only to streamed responses (a non-streamed response always carries usage)",
        _stream_options,
        instead="set stream: true",
    ),
    # A dotted name is a field inside an object field (checked after the object's own row).
    "stream_options.continuous_usage_stats": Unsupported(
        "adds usage to every streamed chunk",
        default(False),
        instead="set stream_options.include_usage for usage in the last chunk",
    ),
    "modalities": Unsupported("asks for audio output", default(["text"]), CHAT),
    "audio": Unsupported("asks for audio output", endpoints=CHAT),
    "web_search_options": Unsupported("asks for web search", endpoints=CHAT),
    "reasoning_effort": Unsupported("sets a reasoning model's effort", endpoints=CHAT),
    "verbosity": Unsupported("sets a model's answer length", endpoints=CHAT),
    # ---- vLLM's extensions ----
    "guided_whitespace_pattern": Unsupported(
        "sets the whitespace of constrained JSON",
        instead="set structured_outputs.disable_any_whitespace for compact JSON",
    ),
    "guided_decoding_backend": Unsupported(
        "selects a structured-output backend other than the one this server runs "
        f"(llguidance; {', '.join(repr(b) for b in _BACKENDS)} are accepted)",
        default(*_BACKENDS),
    ),
    "structural_tag": Unsupported(
        "constrains the output with structural tags", instead="use tools or a json_schema"
    ),
    "use_beam_search": Unsupported("asks for beam search", default(False)),
    "length_penalty": Unsupported("applies to beam search, which is not supported", default(1.0)),
    "min_tokens": Unsupported("forbids ending before a number of tokens", default(0)),
    "bad_words": Unsupported("forbids words", default([])),
    "allowed_token_ids": Unsupported("restricts the vocabulary"),
    "logits_processors": Unsupported("runs custom logits processors", default([])),
    "prompt_logprobs": Unsupported("asks for the prompt's logprobs"),
    "truncate_prompt_tokens": Unsupported(
        "truncates the prompt", instead="send a prompt that fits the context"
    ),
    "spaces_between_special_tokens": Unsupported(
        "changes how special tokens are detokenized", default(True)
    ),
    "return_tokens_as_token_ids": Unsupported("writes logprob tokens as token ids", default(False)),
    "return_token_ids": Unsupported("returns token ids with the text", default(False)),
    "lora_request": Unsupported(
        "selects an adapter", instead="name the adapter in the model field"
    ),
    "cache_salt": Unsupported("salts the prefix cache (loraplex already salts it per tenant)"),
    "kv_transfer_params": Unsupported("asks for disaggregated serving"),
    "vllm_xargs": Unsupported("passes arguments to custom extensions", default({})),
    "max_repetition_pattern_size": Unsupported("stops on repeated patterns", default(0)),
    "min_repetition_pattern_size": Unsupported("stops on repeated patterns", default(0)),
    "repetition_min_count": Unsupported("stops on repeated patterns", default(0)),
    "prompt_embeds": Unsupported("takes the prompt as embeddings", endpoints=COMPLETIONS),
    "chat_template": Unsupported("replaces the model's chat template", endpoints=CHAT),
    "chat_template_kwargs": Unsupported("passes variables to the chat template", default({}), CHAT),
    "documents": Unsupported("passes documents to the chat template (RAG)", endpoints=CHAT),
    "mm_processor_kwargs": Unsupported("configures multimodal inputs", default({}), CHAT),
    "media_io_kwargs": Unsupported("configures multimodal inputs", default({}), CHAT),
    "include_reasoning": Unsupported(
        "strips a reasoning model's reasoning (there is no reasoning parser)",
        default(True),
        CHAT,
    ),
}

# Fields of OpenAI's or vLLM's schemas that change nothing in the output: ignored on purpose
# (storage, billing, tracing, latency hints). Unknown fields are ignored too.
IGNORED = frozenset(
    (
        "metadata",
        "store",
        "service_tier",
        "user",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "prediction",
        "request_id",
    )
)


def refuse_unsupported(body: BaseModel, endpoint: Endpoint) -> None:
    """400 ``unsupported_parameter`` for the first field of ``UNSUPPORTED`` that ``body`` sets
    to a value that is not harmless."""
    for name, rule in UNSUPPORTED.items():
        if endpoint not in rule.endpoints:
            continue
        found, value = _field(body, name.split("."))
        if found and not rule.harmless(value, body):
            raise unsupported(name, rule)


def _field(model: BaseModel, path: list[str]) -> tuple[bool, Any]:
    """(sent, value) of the field at ``path`` (a dotted name, split): declared or kept in
    ``model_extra``; an object left null or absent holds no field."""
    value: Any = model
    for key in path:
        if isinstance(value, BaseModel):
            if key in type(value).model_fields:
                value = getattr(value, key)
                continue
            value = value.model_extra or {}
        if not isinstance(value, dict) or key not in value:
            return False, None
        value = value[key]
    return True, value


def unsupported(name: str, rule: Unsupported) -> APIError:
    instead = f"; {rule.instead}" if rule.instead else ""
    return invalid_request(
        f"'{name}' is not supported by this server: it {rule.why}. Remove '{name}' from the "
        f"request{instead}.",
        name,
        "unsupported_parameter",
    )
