"""Chat messages -> prompt token ids, through the model's own chat template."""

from __future__ import annotations

from typing import Any

from loraplex.platform.openai.errors import clip, invalid_request
from loraplex.platform.openai.protocol import ChatMessage


def render_chat(
    tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool
) -> list[int]:
    if not messages:
        raise invalid_request(
            "messages is empty; send at least one message, e.g. "
            '[{"role": "user", "content": "Hello"}].',
            "messages",
            "empty_messages",
        )
    conversation = [_template_message(m, i) for i, m in enumerate(messages)]
    if not getattr(tokenizer, "chat_template", None):
        raise invalid_request(
            "The served model has no chat template, so chat messages cannot be formatted; use "
            "/v1/completions with a prompt, or serve a model whose tokenizer has a chat template.",
            "messages",
            "chat_template_missing",
        )
    import jinja2

    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
        # Templates refuse some conversations on purpose (e.g. "roles must alternate").
        raise invalid_request(
            f"The model's chat template cannot format these messages: {exc}. Change the "
            "messages (their roles and order) to what this model accepts.",
            "messages",
            "chat_template_error",
        ) from None
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not str")
    # The template writes the special tokens (BOS and the like) itself.
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
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
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out
