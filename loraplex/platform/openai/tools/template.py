"""Tools, earlier calls and tool results -> what the chat template gets.

A template that reads ``tools`` (Qwen's, Hermes') is given the tools (``tools=`` of
``apply_chat_template``) and the messages as Hugging Face writes them: an assistant message's
``tool_calls`` with the arguments as an object, ``role: tool`` messages with their
``tool_call_id``. For any other template (SmolLM2's) loraplex writes them in the format's words
(see ``formats``): the tools into the system prompt, the calls into the assistant's content,
each run of tool results into one user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.platform.openai.tools.formats import TemplateTools
from loraplex.platform.openai.tools.request import Tool


@dataclass(frozen=True)
class ToolPrompt:
    """The template's tool calling and the tools offered to the model (empty: none)."""

    template: TemplateTools
    tools: tuple[Tool, ...] = ()


def prepare(
    conversation: list[dict[str, Any]], prompt: ToolPrompt
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for ``apply_chat_template``."""
    if prompt.template.native:
        return conversation, [t.openai() for t in prompt.tools] or None
    fmt = prompt.template.format
    out: list[dict[str, Any]] = []
    for message in conversation:
        if message["role"] == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            written = fmt.render_calls(
                [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            )
            message["content"] = (
                f"{message['content']}\n{written}" if message["content"] else written
            )
        out.append(message)
    for message in out:
        message.pop("_tool_results", None)
    if prompt.tools:
        _add_system(out, fmt.system_prompt(prompt.tools))
    return out, None


def _add_system(messages: list[dict[str, Any]], text: str) -> None:
    if messages and messages[0]["role"] == "system":
        head = messages[0]["content"]
        messages[0] = {**messages[0], "content": f"{head}\n\n{text}" if head else text}
    else:
        messages.insert(0, {"role": "system", "content": text})
