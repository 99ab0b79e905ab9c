"""Chat messages -> prompt token ids, through the model's own chat template."""

from __future__ import annotations

import json
from typing import Any

from loraplex.platform.errors import clip, invalid_request, shorten
from loraplex.platform.openai.protocol import ChatMessage, ToolCallIn
from loraplex.platform.openai.tools.formats import template_tools
from loraplex.platform.openai.tools.template import ToolPrompt, prepare


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    tools: ToolPrompt | None = None,
) -> list[int]:
    """The prompt's token ids (``render_chat_text``, then tokenized)."""
    text = render_chat_text(
        tokenizer,
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
    )
    return tokenize_chat(tokenizer, text)


def render_chat_text(
    tokenizer: Any,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    tools: ToolPrompt | None = None,
) -> str:
    """The conversation through the model's chat template, as Hugging Face renders it.

    ``add_generation_prompt``: the text ends with the assistant's turn opener (the template's
    generation prompt). ``continue_final_message``: the last message, the assistant's, is left
    open (the template's text after its content is cut), so the model continues it; the two
    exclude each other (the caller checks). ``tools``: the tools offered to the model (the
    template's own tool calling, or loraplex's words for it: ``tools.template``); earlier calls
    and tool results are rendered the same way with or without it.
    """
    if not messages:
        raise invalid_request(
            "messages is empty; send at least one message, e.g. "
            '[{"role": "user", "content": "Hello"}].',
            "messages",
            "empty_messages",
        )
    if continue_final_message and messages[-1].role != "assistant":
        raise invalid_request(
            f"continue_final_message continues the last message, which must be the "
            f"assistant's; messages[{len(messages) - 1}] is a {messages[-1].role} message. End "
            "the messages with the assistant's partial answer, or drop continue_final_message.",
            "continue_final_message",
            "invalid_value",
        )
    conversation = [_template_message(m, i) for i, m in enumerate(messages)]
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise invalid_request(
            "The served model has no chat template, so chat messages cannot be formatted; use "
            "/v1/completions with a prompt, or serve a model whose tokenizer has a chat template.",
            "messages",
            "chat_template_missing",
        )
    conversation, tool_specs = prepare(
        conversation, tools or ToolPrompt(template_tools(str(template)))
    )
    import jinja2

    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tool_specs,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
        # Templates refuse some conversations on purpose (e.g. "roles must alternate"), and
        # continue_final_message fails where a template rewrites the last message (its message
        # quotes the whole rendered prompt: cut).
        raise invalid_request(
            f"The model's chat template cannot format these messages: {shorten(str(exc), 300)}. "
            "Change the messages (their roles and order) to what this model accepts.",
            "messages",
            "chat_template_error",
        ) from None
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
    return text


def tokenize_chat(tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """A rendered conversation's token ids; the template writes the special tokens (BOS and the
    like) itself, so by default none are added."""
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens, verbose=False).input_ids)
    if not ids:
        raise invalid_request(
            "The messages render to an empty prompt; send some text.", "messages", "empty_prompt"
        )
    return ids


def _template_message(message: ChatMessage, i: int) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if part.type != "text":
                raise invalid_request(
                    f"messages[{i}].content[{j}] is a {clip(part.type, 40)} part; this model "
                    "takes only text parts ({'type': 'text', 'text': ...}).",
                    f"messages[{i}].content[{j}].type",
                    "unsupported_content",
                )
            if part.text is None:
                raise invalid_request(
                    f"messages[{i}].content[{j}] is a text part without its 'text'; send "
                    "{'type': 'text', 'text': ...}.",
                    f"messages[{i}].content[{j}].text",
                    "missing_text",
                )
            parts.append(part.text)
        text = "\n".join(parts)
    else:
        text = content or ""
    # "developer" is OpenAI's newer name for "system"; templates know only "system".
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": text}
    if message.name is not None:
        out["name"] = message.name
    if message.role == "tool":
        if message.tool_call_id is None:
            raise invalid_request(
                f"messages[{i}] is a tool message without its tool_call_id; send the id of "
                "the call it answers (the assistant message's tool_calls[].id).",
                f"messages[{i}].tool_call_id",
                "missing_tool_call_id",
            )
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        if message.role != "assistant":
            raise invalid_request(
                f"messages[{i}] is a {message.role} message with tool_calls; only the "
                "assistant's messages hold tool calls.",
                f"messages[{i}].tool_calls",
                "invalid_value",
            )
        out["tool_calls"] = [_template_call(c, i, j) for j, c in enumerate(message.tool_calls)]
    return out


def _template_call(call: ToolCallIn, i: int, j: int) -> dict[str, Any]:
    """An earlier call as Hugging Face templates read it: the arguments as an object."""
    where = f"messages[{i}].tool_calls[{j}]"
    if call.type != "function":
        raise invalid_request(
            f"{where}.type is {clip(call.type, 40)!r}; only 'function' calls are supported.",
            f"{where}.type",
            "invalid_value",
        )
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # a RecursionError: nested too deep to read
        arguments = None
    if not isinstance(arguments, dict):
        raise invalid_request(
            f"{where}.function.arguments is not a JSON object as text (such as "
            '\'{"city": "Paris"}\'); send the arguments the call was made with.',
            f"{where}.function.arguments",
            "invalid_tool_call",
        )
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }
    if call.id is not None:
        out["id"] = call.id
    return out
