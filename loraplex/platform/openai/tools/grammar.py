"""The grammar that enforces ``tool_choice`` ``required`` or a named function: Lark text in
llguidance's dialect, with each tool's parameters embedded as a JSON schema (``%json``), so the
arguments always validate against the tool's schema.

For the hermes format, two tools, parallel calls::

    start: "<tool_call>\\n" call ("\\n</tool_call>\\n<tool_call>\\n" call)* "\\n</tool_call>"
    call: call_0 | call_1
    call_0: "{\\"name\\": \\"get_weather\\", \\"arguments\\": " args_0 "}"
    args_0: %json {"type": "object", ...}

A named choice or ``parallel_tool_calls: false``: exactly one call. With ``tool_choice: auto``
and a JSON ``response_format``, :func:`calls_or_json` lets the model answer either way.

The arguments are written compactly (``", "`` and ``": "``, no free whitespace): a small model
given free whitespace may spend its tokens on newlines.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from loraplex.platform.openai.tools.formats import ToolCallFormat
from loraplex.platform.openai.tools.request import ToolPlan

# llguidance's JSON options, inside each embedded schema
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_grammar(fmt: ToolCallFormat, plan: ToolPlan) -> str:
    """The grammar of an answer that is only tool calls (``plan.forced``)."""
    tools = plan.callable
    many = "" if plan.max_calls == 1 else f" ({_literal(fmt.separator)} call)*"
    lines = [
        "start: calls",
        f"calls: {_literal(fmt.block_open)} call{many} {_literal(fmt.block_close)}",
        "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        lines.append(f'call_{i}: {_literal(fmt.call_prefix(tool.name))} args_{i} "}}"')
        lines.append(f"args_{i}: %json {_schema(tool.parameters)}")
    return "\n".join(lines) + "\n"


def calls_or_json(fmt: ToolCallFormat, plan: ToolPlan, schema: Mapping[str, Any] | None) -> str:
    """Tool calls, or a JSON answer matching ``schema`` (None: any JSON object): the grammar of
    ``tool_choice: auto`` with a JSON ``response_format``."""
    calls = tool_grammar(fmt, plan).replace("start: calls\n", "", 1)
    answer = {"type": "object"} if schema is None else schema
    return f"start: calls | answer\nanswer: %json {_schema(answer, compact=False)}\n{calls}"


def _schema(schema: Mapping[str, Any], *, compact: bool = True) -> str:
    """A schema as one line of JSON for ``%json``, with the compact-output options (unless the
    schema sets its own ``x-guidance``)."""
    out = dict(schema)
    if compact and "x-guidance" not in out:
        out["x-guidance"] = COMPACT
    return json.dumps(out, ensure_ascii=False)


def _literal(text: str) -> str:
    """A Lark string literal (JSON's escapes, which llguidance's Lark reads)."""
    return json.dumps(text, ensure_ascii=False)
