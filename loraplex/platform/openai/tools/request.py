"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request -> one ``ToolPlan``,
every name and size checked (400s that name the field and the limit).

``tool_choice``: ``none`` (the tools are not shown to the model; nothing is parsed), ``auto``
(the default with tools: the model writes text or calls, parsed from its output), ``required``
(one call or more, enforced by a grammar over the tools' schemas), or
``{"type": "function", "function": {"name": ...}}`` (exactly one call of that tool, enforced).
``parallel_tool_calls: false`` allows one call per answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from loraplex.platform.errors import clip, invalid_request
from loraplex.platform.openai.protocol import NamedToolChoice, ToolDefinition
from loraplex.platform.openai.structured import check_schema

MAX_TOOLS = 128  # OpenAI's limit
MAX_DESCRIPTION_CHARS = 4096
MAX_TOOLS_CHARS = 256 * 1024  # all the tools' schemas and descriptions, as JSON
# OpenAI's pattern; it also keeps names safe to write into prompts and grammars as they are
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}

Choice = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of the arguments object

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI (and Hugging Face chat templates) write it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """The tools offered to the model and how it may use them."""

    tools: tuple[Tool, ...]
    choice: Choice
    parallel: bool  # more than one call per answer
    named: str | None = None  # the tool of a named choice

    @property
    def forced(self) -> bool:
        """The output must be tool calls (a grammar enforces them)."""
        return self.choice != "auto"

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools the model may call (a named choice: only that one)."""
        return tuple(t for t in self.tools if self.named is None or t.name == self.named)

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel and self.named is None else 1


class ToolFields(Protocol):
    """A request with OpenAI's tool fields (chat completions, /tokenize)."""

    @property
    def tools(self) -> list[ToolDefinition] | None: ...
    @property
    def tool_choice(self) -> str | NamedToolChoice | None: ...
    @property
    def parallel_tool_calls(self) -> bool | None: ...


def tool_plan(body: ToolFields) -> ToolPlan | None:
    """The request's tool plan; None when no tool is in play (no tools, or ``tool_choice``
    ``none``)."""
    raw_tools = body.tools or []
    choice = body.tool_choice
    named: str | None = None
    if choice is None:
        mode = "auto" if raw_tools else "none"
    elif isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid_request(
                f"tool_choice is {clip(choice, 40)!r}; it must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}.',
                "tool_choice",
                "invalid_value",
            )
        mode = choice
    else:
        if choice.type != "function":
            raise invalid_request(
                f"tool_choice.type is {clip(choice.type, 40)!r}; only 'function' is supported.",
                "tool_choice.type",
                "invalid_value",
            )
        mode, named = "named", choice.function.name
    if not raw_tools:
        if mode in ("none", "auto"):
            return None
        raise invalid_request(
            f"tool_choice {'names a function' if named else repr(mode)} but the request has no "
            "tools; send the functions in tools, or drop tool_choice.",
            "tool_choice",
            "missing_tools",
        )
    tools = _tools(body)
    if mode == "none":
        return None
    if named is not None and named not in {t.name for t in tools}:
        raise invalid_request(
            f"tool_choice names the function {clip(named, 64)}, which is not one of the "
            f"tools ({', '.join(t.name for t in tools[:10])}); name one of them.",
            "tool_choice.function.name",
            "unknown_tool",
        )
    parallel = body.parallel_tool_calls is not False
    chosen: Choice = "named" if named is not None else "required" if mode == "required" else "auto"
    return ToolPlan(tuple(tools), chosen, parallel, named)


def _tools(body: ToolFields) -> list[Tool]:
    raw = body.tools or []
    if len(raw) > MAX_TOOLS:
        raise invalid_request(
            f"tools holds {len(raw)} tools; at most {MAX_TOOLS} are allowed. Send the ones "
            "this request needs.",
            "tools",
            "too_many_tools",
        )
    tools: list[Tool] = []
    seen: set[str] = set()
    size = 0
    for i, spec in enumerate(raw):
        where = f"tools[{i}]"
        if spec.type != "function":
            raise invalid_request(
                f"{where}.type is {clip(spec.type, 40)!r}; only 'function' tools are supported.",
                f"{where}.type",
                "invalid_value",
            )
        fn = spec.function
        if not TOOL_NAME.fullmatch(fn.name):
            raise invalid_request(
                f"{where}.function.name is {clip(fn.name, 80)!r}; a tool's name is 1 to 64 "
                "letters, digits, underscores or dashes.",
                f"{where}.function.name",
                "invalid_tool_name",
            )
        if fn.name in seen:
            raise invalid_request(
                f"{where}.function.name {fn.name!r} names two tools; give each tool its own name.",
                f"{where}.function.name",
                "duplicate_tool_name",
            )
        seen.add(fn.name)
        if fn.description is not None and len(fn.description) > MAX_DESCRIPTION_CHARS:
            raise invalid_request(
                f"{where}.function.description is {len(fn.description):,} characters; at most "
                f"{MAX_DESCRIPTION_CHARS:,} are allowed.",
                f"{where}.function.description",
                "description_too_long",
            )
        parameters = NO_ARGUMENTS if fn.parameters is None else fn.parameters
        param = f"{where}.function.parameters"
        check_schema(parameters, param)
        kind = parameters.get("type", "object")
        if kind != "object":
            raise invalid_request(
                f"{param} has type {clip(kind, 40)!r}; a tool's arguments are an object: "
                '{"type": "object", "properties": {...}}.',
                param,
                "invalid_schema",
            )
        tool = Tool(fn.name, fn.description, parameters)
        size += len(json.dumps(tool.openai(), separators=(",", ":")))
        if size > MAX_TOOLS_CHARS:
            raise invalid_request(
                f"tools take more than {MAX_TOOLS_CHARS:,} characters as JSON (at {where}); send "
                "fewer tools or shorter schemas and descriptions.",
                "tools",
                "tools_too_large",
            )
        tools.append(tool)
    return tools
