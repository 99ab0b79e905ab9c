"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, for clients that build their own
prompts::

    /tokenize    {"model", "prompt"}                      -> {"count", "max_model_len",
                 {"model", "messages", "tools"?,              "tokens", "token_strs"}
                  "add_generation_prompt"?, "continue_final_message"?}
                 (+ "add_special_tokens", "return_token_strs")
    /detokenize  {"model", "tokens"}                      -> {"prompt"}

``model`` resolves for the caller exactly as on the completion endpoints (a tenant's adapter, or
404 ``model_not_found`` for anyone else's); an adapter shares the base model's tokenizer. A chat
conversation renders exactly as ``/v1/chat/completions`` would render it (the tools included).
The work runs in the prompt threads, never on the event loop, and is bounded: a prompt of at
most ``MAX_TOKENIZE_CHARS`` characters, at most ``MAX_DETOKENIZE_TOKENS`` ids, each in the
vocabulary.

Both count against the caller's quotas like a completion: admitted (requests/minute, tokens/
minute, concurrency; 429 when over) after the cheap checks and before any tokenizer work, on a
token bound computed without tokenizing (``_token_bound``), and charged the tokens they return
(``count``, or the ids detokenized).
"""

from __future__ import annotations

from typing import Any

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field

from loraplex.platform.auth import Caller
from loraplex.platform.errors import invalid_request
from loraplex.platform.openai.chat import render_chat_text, tokenize_chat
from loraplex.platform.openai.protocol import (
    Bool,
    ChatMessage,
    NamedToolChoice,
    Text,
    TokenId,
    ToolDefinition,
    _Request,
)
from loraplex.platform.openai.serving import OpenAIServing
from loraplex.platform.openai.tools.formats import template_tools
from loraplex.platform.openai.tools.request import tool_plan
from loraplex.platform.openai.tools.template import ToolPrompt
from loraplex.platform.quotas import text_token_bound

MAX_TOKENIZE_CHARS = 1 << 20
MAX_DETOKENIZE_TOKENS = 1 << 17


# vLLM's /tokenize fields that would change the tokens and are not implemented: refused by name
# (ignoring them would answer with other tokens than the client asked for).
UNSUPPORTED = ("chat_template", "chat_template_kwargs", "documents", "mm_processor_kwargs")


class TokenizeRequest(_Request):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # see UNSUPPORTED

    model: Text | None = Field(None, max_length=256)  # None: the base model
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = None  # default true for a prompt, false for messages
    add_generation_prompt: Bool | None = True
    continue_final_message: Bool | None = False
    return_token_strs: Bool | None = False
    tools: list[ToolDefinition] | None = None
    tool_choice: Text | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: Text | None = Field(None, max_length=256)
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(
    serving: OpenAIServing, body: TokenizeRequest, caller: Caller
) -> TokenizeResponse:
    await serving.resolver.lookup(caller, body.model or serving.resolver.base_name)
    for name in UNSUPPORTED:
        if (body.model_extra or {}).get(name) not in (None, {}, []):
            raise invalid_request(
                f"'{name}' is not supported by this server's /tokenize: the model's own chat "
                f"template renders the messages. Remove '{name}' from the request.",
                name,
                "unsupported_parameter",
            )
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request(
            "Send either prompt (a text) or messages (a chat conversation), not both and not "
            "neither.",
            "messages" if body.prompt is not None else "prompt",
            "invalid_value",
        )
    text_len = len(body.prompt) if body.prompt is not None else _messages_chars(body.messages)
    if text_len > MAX_TOKENIZE_CHARS:
        param = "prompt" if body.prompt is not None else "messages"
        raise invalid_request(
            f"The {param} holds {text_len:,} characters; /tokenize takes at most "
            f"{MAX_TOKENIZE_CHARS:,}. Tokenize it in parts.",
            param,
            "prompt_too_long",
        )
    tokenizer = await serving.tokenizer()
    lease = await serving.admit(caller, _token_bound(serving, body, tokenizer))
    count = 0  # charged: the tokens returned (none when it fails)
    try:
        ids, strs = await _tokenized(serving, body, tokenizer)
        count = len(ids)
    finally:
        lease.finish(count)
    return TokenizeResponse(
        count=len(ids),
        max_model_len=serving.client.info.max_model_len,
        tokens=ids,
        token_strs=strs,
    )


def _token_bound(serving: OpenAIServing, body: TokenizeRequest, tokenizer: Any) -> int:
    """At most how many tokens ``body`` tokenizes to, without tokenizing it (the quota
    reservation while it runs): a prompt's UTF-8 bytes and the special tokens added (see
    ``quotas``); a conversation's JSON bytes (every text the template may write, escaped, is
    at least its UTF-8 bytes) and the tools', plus the template's own text once per message and
    once for the generation prompt (loraplex's own tool instructions, for a template without
    tools, can add a few more: the reservation lasts only while the tokenizer runs, and the
    charge is the exact count)."""
    if body.prompt is not None:
        specials = serving.special_tokens(tokenizer, body.add_special_tokens is not False)
        return text_token_bound(body.prompt, specials)
    specials = serving.special_tokens(tokenizer, bool(body.add_special_tokens))
    template = getattr(tokenizer, "chat_template", None) or ""
    template_bytes = len(str(template).encode("utf-8"))
    texts = len(pydantic_core.to_json(body.messages)) + len(pydantic_core.to_json(body.tools))
    messages = len(body.messages or ())
    return texts + (messages + 1) * template_bytes + specials + 1


async def _tokenized(
    serving: OpenAIServing, body: TokenizeRequest, tokenizer: Any
) -> tuple[list[int], list[str] | None]:
    prompt = None
    if body.messages is not None:
        if (
            body.continue_final_message
            and body.add_generation_prompt
            and ("add_generation_prompt" in body.model_fields_set)
        ):
            raise invalid_request(
                "add_generation_prompt: true opens a new assistant turn, while "
                "continue_final_message: true continues the last message; set only one.",
                "continue_final_message",
                "invalid_value",
            )
        plan = tool_plan(body)
        template = template_tools(getattr(tokenizer, "chat_template", None))
        prompt = ToolPrompt(template, plan.tools if plan else ())
    continued = bool(body.continue_final_message)

    def run() -> tuple[list[int], list[str] | None]:
        if body.messages is not None:
            text = render_chat_text(
                tokenizer,
                body.messages,
                add_generation_prompt=body.add_generation_prompt is not False and not continued,
                continue_final_message=continued,
                tools=prompt,
            )
            ids = tokenize_chat(tokenizer, text, bool(body.add_special_tokens))
        else:
            special = body.add_special_tokens is not False
            ids = list(tokenizer(body.prompt, add_special_tokens=special, verbose=False).input_ids)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return ids, strs

    return await serving.prompts.run(run)


async def detokenize(
    serving: OpenAIServing, body: DetokenizeRequest, caller: Caller
) -> DetokenizeResponse:
    await serving.resolver.lookup(caller, body.model or serving.resolver.base_name)
    tokens = body.tokens
    if len(tokens) > MAX_DETOKENIZE_TOKENS:
        raise invalid_request(
            f"tokens holds {len(tokens):,} ids; /detokenize takes at most "
            f"{MAX_DETOKENIZE_TOKENS:,}. Send them in parts.",
            "tokens",
            "too_many_tokens",
        )
    lease = await serving.admit(caller, len(tokens))
    count = 0  # charged: the ids detokenized (none when it fails)
    try:
        text = await _detokenized(serving, tokens)
        count = len(tokens)
    finally:
        lease.finish(count)
    return DetokenizeResponse(prompt=text)


async def _detokenized(serving: OpenAIServing, tokens: list[int]) -> str:
    tokenizer = await serving.tokenizer()
    vocab = len(tokenizer)
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab:
            raise invalid_request(
                f"tokens[{i}] is {token if abs(token) < 10**12 else 'a huge number'}, not a "
                f"token id of this model (0..{vocab - 1}).",
                f"tokens[{i}]",
                "invalid_token_id",
            )

    def run() -> str:
        return str(tokenizer.decode(tokens))

    return await serving.prompts.run(run)


def _messages_chars(messages: list[ChatMessage] | None) -> int:
    total = 0
    for m in messages or ():
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content is not None:
            total += sum(len(p.text or "") for p in m.content)
    return total
