"""A choice's generated text -> OpenAI's assistant message with ``tool_calls`` (whole), or its
stream deltas (``content`` and incremental ``tool_calls``), and its ``finish_reason``.

``finish_reason`` is ``tool_calls`` when the answer holds calls and the model ended it (``stop``);
an answer cut by ``max_tokens`` keeps ``length``. Under a forced choice (required, named) the
answer is only calls, so ``content`` is null; text the model wrote besides calls is content.
"""

from __future__ import annotations

from typing import Any

from loraplex.platform.openai.protocol import ChatResponseMessage, FunctionCall, ToolCall
from loraplex.platform.openai.tools.parser import Piece, ToolCallParser, parse_answer
from loraplex.platform.openai.tools.request import ToolPlan


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def whole_message(
    text: str, reason: str | None, plan: ToolPlan
) -> tuple[ChatResponseMessage, str | None]:
    """The message of a non-streamed choice, and its finish reason."""
    content, calls = parse_answer(text, plan.max_calls)
    tool_calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]
    message = ChatResponseMessage(
        content=content if content or not calls else None, tool_calls=tool_calls or None
    )
    return message, finish_reason(reason, bool(calls))


class StreamedCalls:
    """One streamed choice's parser: each event's text -> the delta to send (None: nothing)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.parser = ToolCallParser(streaming=True, max_calls=plan.max_calls)

    def push(self, text: str, final: bool) -> dict[str, Any] | None:
        piece = self.parser.push(text)
        if final:
            end = self.parser.finish()
            piece = Piece(piece.content + end.content, piece.calls + end.calls)
        return delta_of(piece) if piece else None

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(reason, bool(self.parser.calls))


def delta_of(piece: Piece) -> dict[str, Any]:
    """A stream delta: content, then the calls' deltas (a call's first names it, with empty
    arguments; its arguments' fragments follow, consecutive ones of a call joined)."""
    delta: dict[str, Any] = {}
    if piece.content:
        delta["content"] = piece.content
    calls: list[dict[str, Any]] = []
    for d in piece.calls:
        if d.id is not None:
            calls.append(
                {
                    "index": d.index,
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.name, "arguments": d.arguments},
                }
            )
        elif calls and calls[-1]["index"] == d.index and "id" not in calls[-1]:
            calls[-1]["function"]["arguments"] += d.arguments
        else:
            calls.append({"index": d.index, "function": {"arguments": d.arguments}})
    if calls:
        delta["tool_calls"] = calls
    return delta
