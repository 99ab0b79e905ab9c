"""How a model writes tool calls: a small registry of formats, one chosen per chat template.

* ``hermes`` (Qwen2.5/3, Hermes, and the default): one block per call::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

* ``smollm2`` (the SmolLM2 family's function calling, from its model card): one block holding
  a JSON list of calls::

      <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]</tool_call>

Both are read by one parser (``parser.py``: a block may hold one call object or a list of
them), whatever format the template asked for. A template that knows tools (it reads the
``tools`` variable, as Qwen's does) renders the tools, the assistant's earlier calls and the
tool results itself. A template that does not (SmolLM2-135M-Instruct's has no tool support)
gets them from loraplex, in the format's own words: the tools in the system prompt (the
format's ``system_prompt``), earlier calls written into the assistant's content, tool results
as user turns in ``<tool_response>`` tags (as Qwen's template writes them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loraplex.platform.openai.tools.request import Tool

START = "<tool_call>"
END = "</tool_call>"

_HERMES_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

# SmolLM2's function-calling prompt (its model card), with the tools in the same tags.
_SMOLLM2_PROMPT = """You are an expert in composing functions. You are given a question and a \
set of possible functions. Based on the question, you will need to make one or more \
function/tool calls to achieve the purpose. If none of the functions can be used, point it \
out and answer in plain text.

You have access to the following tools:
<tools>{tools}</tools>

To call functions, answer in this format, with no other text:
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
... (more tool calls as required)
]</tool_call>"""


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    as_list: bool  # one block holds a JSON list of calls (else one block per call)

    def system_prompt(self, tools: Sequence[Tool]) -> str:
        """The tools, described to a model whose template cannot."""
        if self.as_list:
            listed = json.dumps([t.openai() for t in tools], ensure_ascii=False)
            return _SMOLLM2_PROMPT.format(tools=listed)
        lines = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        return _HERMES_PROMPT.format(tools=lines)

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Earlier calls (name, arguments object) as the model would have written them."""
        objects = [
            json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            for name, args in calls
        ]
        if self.as_list:
            return f"{START}[{', '.join(objects)}]{END}"
        return "\n".join(f"{START}\n{o}\n{END}" for o in objects)

    def call_prefix(self, name: str) -> str:
        """The text of one call up to its arguments (grammars write it as a literal)."""
        return f'{{"name": "{name}", "arguments": '

    @property
    def block_open(self) -> str:
        return START + ("[" if self.as_list else "\n")

    @property
    def block_close(self) -> str:
        return ("]" if self.as_list else "\n") + END

    @property
    def separator(self) -> str:
        """Between two calls: inside the list, or between blocks."""
        return ", " if self.as_list else f"\n{END}\n{START}\n"


HERMES = ToolCallFormat("hermes", as_list=False)
SMOLLM2 = ToolCallFormat("smollm2", as_list=True)
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, SMOLLM2)}

_READS_TOOLS = re.compile(r"\btools\b")


@dataclass(frozen=True)
class TemplateTools:
    """A chat template's tool calling: the format its model writes, and whether the template
    renders tools itself (``native``) or loraplex does."""

    format: ToolCallFormat
    native: bool


def template_tools(chat_template: str | None) -> TemplateTools:
    """A template that writes lists of calls is ``smollm2``'s; so is SmolLM2's own template,
    which knows no tools (newer SmolLM templates that render tools say how themselves); any
    other is ``hermes``."""
    template = chat_template or ""
    native = bool(_READS_TOOLS.search(template))
    if START + "[" in template or (not native and "SmolLM" in template):
        return TemplateTools(SMOLLM2, native)
    return TemplateTools(HERMES, native)
