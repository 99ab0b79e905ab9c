"""A chat request's tool plan and its other constraint -> the one constraint the engine gets.

* ``tool_choice`` required or named: the tool-call grammar (and any other constraint is a 400:
  the output cannot be both);
* ``auto`` with a JSON ``response_format`` (or ``structured_outputs.json``/``json_object``): a
  grammar that allows tool calls or the JSON answer;
* ``auto`` with a regex, choice or grammar: a 400 (the two cannot be joined);
* ``auto`` alone: no constraint, the model chooses, and its calls are parsed.
"""

from __future__ import annotations

from loraplex.grammar import MAX_GRAMMAR_CHARS
from loraplex.platform.errors import APIError, invalid_request
from loraplex.platform.openai.structured import Constraint, conflict_with_tools
from loraplex.platform.openai.tools.formats import ToolCallFormat
from loraplex.platform.openai.tools.grammar import calls_or_json, tool_grammar
from loraplex.platform.openai.tools.request import ToolPlan
from loraplex.sampling_params import StructuredOutputsParams

TOOLS_SUBJECT = "tools' parameter schemas"


def with_tools(
    constraint: Constraint | None, plan: ToolPlan | None, fmt: ToolCallFormat
) -> Constraint | None:
    if plan is None:
        return constraint
    if plan.forced:
        if constraint is not None:
            choice = "'required'" if plan.named is None else "naming a function"
            raise conflict_with_tools(constraint, choice)
        grammar = tool_grammar(fmt, plan)
        param = "tools" if plan.named is None else "tool_choice"
        _check_size(grammar, param)
        return Constraint(StructuredOutputsParams(grammar=grammar), param, TOOLS_SUBJECT)
    if constraint is None:
        return None
    kind = constraint.params.kind
    if kind not in ("json", "json_object"):
        raise invalid_request(
            f"{constraint.param} cannot be combined with tools under tool_choice 'auto': only "
            "a JSON answer (response_format json_schema or json_object) can stand beside tool "
            "calls. Drop one of them, or set tool_choice to 'none'.",
            constraint.param,
            "conflicting_constraints",
        )
    schema = constraint.params.json if kind == "json" else None
    grammar = calls_or_json(fmt, plan, schema if isinstance(schema, dict) else None)
    _check_size(grammar, constraint.param)
    subject = f"schema or the {TOOLS_SUBJECT}"
    return Constraint(StructuredOutputsParams(grammar=grammar), constraint.param, subject)


def _check_size(grammar: str, param: str) -> None:
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise APIError(
            400,
            f"The tools' parameter schemas are too large to enforce together: their grammar "
            f"would be {len(grammar):,} characters, and at most {MAX_GRAMMAR_CHARS:,} are "
            "allowed. Send fewer tools, or smaller schemas (shorter descriptions).",
            param=param,
            code="tools_too_large",
        )
