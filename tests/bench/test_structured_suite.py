"""The structured-output suite's corpus and checks, with no server: every schema is a valid Draft
2020-12 schema with hand-written instances that validate, bounded so its ``max_tokens`` covers
its longest output; the corpus covers the keywords issue 16 lists; the checks accept good
outputs and refuse bad ones; the plan sends half the schemas through an adapter, some streamed."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter

import pytest
from jsonschema import Draft202012Validator

from benchmarks.structured_suite.check import (
    Outcome,
    ToolCall,
    ToolCallAssembler,
    check_choice,
    check_finish,
    check_json,
    check_pattern,
    check_refusal,
    check_tool_calls,
    totals,
)
from benchmarks.structured_suite.constraints import (
    CONSTRAINT_CASES,
    PARSE_CASES,
    REFUSAL_CASES,
    TOOL_CASES,
    TOOL_EXAMPLES,
    TOOLS,
    ConstraintCase,
    ToolCase,
)
from benchmarks.structured_suite.options import (
    KINDS,
    SuiteOptions,
    add_suite_arguments,
    options_from,
)
from benchmarks.structured_suite.run import pick_models, plan
from benchmarks.structured_suite.schemas import (
    FEATURES,
    SCHEMA_CASES,
    SchemaCase,
    UnboundedSchema,
    features,
    longest_output,
    obj,
    text,
)


def test_the_corpus_is_as_large_as_the_issue_asks() -> None:
    kinds = Counter(c.kind for c in CONSTRAINT_CASES)
    assert len(SCHEMA_CASES) >= 32
    assert kinds["regex"] >= 5 and kinds["choice"] >= 5 and kinds["grammar"] >= 3
    assert len(TOOL_CASES) >= 6
    assert {c.tool_choice == "required" for c in TOOL_CASES} == {True, False}


def test_names_are_unique_within_each_kind() -> None:
    for cases in (SCHEMA_CASES, CONSTRAINT_CASES, TOOL_CASES, PARSE_CASES):
        names = [(getattr(c, "kind", ""), c.name) for c in cases]
        assert len(names) == len(set(names)), [n for n, k in Counter(names).items() if k > 1]


@pytest.mark.parametrize("case", SCHEMA_CASES, ids=lambda c: c.name)
def test_each_schema_is_valid_satisfiable_and_bounded(case: SchemaCase) -> None:
    Draft202012Validator.check_schema(case.schema)
    validator = Draft202012Validator(case.schema)
    assert case.examples
    for example in case.examples:
        assert not list(validator.iter_errors(example)), example
        assert check_json(json.dumps(example), case.schema) is None
    # one token is at least one character: the budget covers the longest compact output
    assert longest_output(case.schema) <= case.max_tokens
    assert case.prompt.strip()


def test_the_schemas_cover_every_keyword_the_issue_lists() -> None:
    seen = Counter(f for c in SCHEMA_CASES for f in features(c.schema))
    assert set(FEATURES) <= set(seen), set(FEATURES) - set(seen)
    assert min(seen[f] for f in ("anyOf", "ref", "nullable", "nested", "pattern")) >= 3, seen


def test_features_and_bounds_read_the_schema() -> None:
    nested = obj({"a": obj({"b": text(3)})})
    assert "nested" in features(nested) and "lengths" in features(nested)
    assert "nested" not in features(obj({"b": text(3)}))
    assert features({"type": ["string", "null"], "maxLength": 2}) >= {"nullable", "lengths"}
    assert longest_output(obj({"b": text(3)})) == len('{"b":"abc"}')
    with pytest.raises(UnboundedSchema, match=r"\$\.b"):
        longest_output(obj({"b": {"type": "string"}}))
    with pytest.raises(UnboundedSchema, match="maxItems"):
        longest_output({"type": "array", "items": text(2)})
    with pytest.raises(UnboundedSchema, match="open"):
        longest_output({"type": "object", "properties": {}})
    with pytest.raises(UnboundedSchema):
        longest_output({"type": "string", "pattern": "^a+$"})


@pytest.mark.parametrize("case", CONSTRAINT_CASES, ids=lambda c: f"{c.kind}-{c.name}")
def test_constraint_examples_are_accepted(case: ConstraintCase) -> None:
    re.compile(case.full_pattern())
    for example in case.examples:
        if case.kind == "choice":
            assert check_choice(example, list(case.value)) is None
        assert check_pattern(example, case.full_pattern()) is None
    body = case.body()
    if case.spelling == "guided":
        assert body == {
            f"guided_{case.kind}": case.value if isinstance(case.value, str) else list(case.value)
        }
    else:
        assert list(body["structured_outputs"]) == [case.kind]


def test_grammar_patterns_refuse_what_the_grammar_refuses() -> None:
    grammar = {c.name: c.full_pattern() for c in CONSTRAINT_CASES if c.kind == "grammar"}
    assert check_pattern("3*(4+1)-2", grammar["arithmetic"]) is None
    for bad in ("3*4=12", "((1+2))", "1+2+3+4+5", ""):
        assert check_pattern(bad, grammar["arithmetic"]) is not None, bad
    assert check_pattern("maybe, because it is", grammar["yes_no_reason"]) is not None
    assert check_pattern("alice,34,Paris", grammar["csv_row"]) is not None
    assert check_pattern("SELECT * FROM t;", grammar["sql_select"]) is not None


def test_check_json_refuses_bad_outputs() -> None:
    schema = SCHEMA_CASES[0].schema
    good = json.dumps(SCHEMA_CASES[0].examples[0])
    assert check_json(good, schema) is None
    assert "not JSON" in (check_json(good[:-1], schema) or "")
    assert "not JSON" in (check_json("", schema) or "")
    wrong = json.loads(good) | {"currency": "DOGE"}
    assert "currency" in (check_json(json.dumps(wrong), schema) or "")
    extra = json.loads(good) | {"note": "x"}
    assert check_json(json.dumps(extra), schema) is not None
    assert check_choice("Positive", ["positive"]) is not None
    assert check_pattern("#12345G", r"#[0-9a-fA-F]{6}") is not None
    assert check_finish("length") and check_finish("stop") is None and check_finish(None) is None


def test_tool_examples_validate_and_tools_are_bounded() -> None:
    assert set(TOOL_EXAMPLES) == set(TOOLS)
    for name, tool in TOOLS.items():
        params = tool["function"]["parameters"]
        Draft202012Validator.check_schema(params)
        assert check_json(json.dumps(TOOL_EXAMPLES[name]), params) is None
        assert longest_output(params) < 256
    for case in TOOL_CASES:
        assert set(case.tools) <= set(TOOLS)
        assert case.tool_choice in ("required", *case.tools)


def test_check_tool_calls() -> None:
    case = ToolCase("t", (), ("get_weather", "lookup_order"), "required", parallel_tool_calls=False)
    good = ToolCall("call_1", "get_weather", json.dumps(TOOL_EXAMPLES["get_weather"]))
    assert check_tool_calls([good], case) is None
    wrong_args = ToolCall("call_1", "get_weather", '{"city": "Madrid", "unit": "kelvin"}')
    assert "unit" in (check_tool_calls([wrong_args], case) or "")
    assert "not JSON" in (check_tool_calls([ToolCall("c", "get_weather", '{"city": ')], case) or "")
    assert "no tool call" in (check_tool_calls([], case) or "")
    assert "parallel" in (check_tool_calls([good, good], case) or "")
    assert "expected" in (check_tool_calls([ToolCall("c", "create_event", "{}")], case) or "")
    assert "no id" in (check_tool_calls([ToolCall("", good.name, good.arguments)], case) or "")
    named = ToolCase("n", (), ("get_weather", "lookup_order"), "lookup_order")
    assert check_tool_calls([good], named) is not None
    order = ToolCall("c", "lookup_order", '{"order_id": "AB123456"}')
    assert check_tool_calls([order], named) is None


def test_streamed_tool_call_deltas_are_joined() -> None:
    joined = ToolCallAssembler()
    joined.add([{"index": 0, "id": "call_a", "function": {"name": "get_weather", "arguments": ""}}])
    joined.add([{"index": 0, "function": {"arguments": '{"city": "Ma'}}])
    joined.add([{"index": 1, "id": "call_b", "function": {"name": "lookup_order"}}])
    joined.add([{"index": 0, "function": {"arguments": 'drid", "unit": "celsius"}'}}])
    joined.add([{"index": 1, "function": {"arguments": '{"order_id": "AB123456"}'}}])
    calls = joined.calls()
    assert [c.id for c in calls] == ["call_a", "call_b"]
    case = ToolCase("t", (), ("get_weather", "lookup_order"), "required")
    assert check_tool_calls(calls, case) is None


def test_the_plan_mixes_adapters_streams_and_sampling() -> None:
    jobs = plan(KINDS)
    schemas = [j for j in jobs if j.kind == "json_schema"]
    assert len(schemas) == len(SCHEMA_CASES)
    assert sum(j.adapter for j in schemas) == len(schemas) // 2
    assert len(schemas) // 4 <= sum(j.streamed for j in schemas) <= len(schemas) // 2
    assert {(j.adapter, j.streamed) for j in schemas} == {(a, s) for a in (0, 1) for s in (0, 1)}
    assert 0 < sum(j.sampled for j in schemas) < len(schemas) // 2
    tools = [(j.case, j.streamed) for j in jobs if isinstance(j.case, ToolCase)]
    choices = {(case.tool_choice == "required", streamed) for case, streamed in tools}
    assert choices == {(r, s) for r in (True, False) for s in (True, False)}
    assert {j.endpoint for j in jobs} == {"chat", "completions"}
    assert [j.case.name for j in plan(("regex",), "ip")] == ["ipv4"]


def test_totals_per_kind() -> None:
    def o(kind: str, valid: bool, finish: str = "stop") -> Outcome:
        return Outcome(kind, "x", "m", None, False, False, "chat", valid, finish)

    t = totals([o("regex", True), o("regex", False, "length"), o("choice", True)])
    assert t["regex"] == {
        "n": 2,
        "valid": 1,
        "percent": 50.0,
        "length": 1,
        "adapter": 0,
        "streamed": 0,
    }
    assert t["all"]["n"] == 3 and t["all"]["valid"] == 2 and t["choice"]["percent"] == 100.0


def test_options_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="kinds"):
        SuiteOptions(kinds=("nope",))
    with pytest.raises(ValueError, match="go together"):
        SuiteOptions(base_url="http://127.0.0.1:1")
    assert "--kinds=regex" in SuiteOptions(kinds=("regex",)).command_line()


def test_the_flags_refuse_bad_values() -> None:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_suite_arguments(p)
    with pytest.raises(argparse.ArgumentError, match="at least 1"):
        p.parse_args(["--concurrency", "0"])
    with pytest.raises(argparse.ArgumentError, match="nope"):
        p.parse_args(["--kinds", "regex,nope"])
    opts = options_from(
        p.parse_args(["--kinds", "regex,tools", "--serve-args", "--max-num-seqs 4"])
    )
    assert opts.kinds == ("regex", "tools") and opts.serve_args == ("--max-num-seqs", "4")
    with pytest.raises(ValueError, match="--api-key"):
        options_from(p.parse_args(["--base-url", "http://127.0.0.1:9"]))


def test_the_suite_uses_the_base_and_the_latest_adapter_names() -> None:
    cards = [
        {"id": "caps@1", "parent": "base"},
        {"id": "base", "parent": None},
        {"id": "pirate", "parent": "base"},
        {"id": "caps", "parent": "base"},
    ]
    assert pick_models(cards) == ("base", ("caps", "pirate"))
    assert pick_models([{"id": "b"}, {"id": "x@2", "parent": "b"}]) == ("b", ("x@2",))


def test_check_refusal_wants_a_400_that_names_the_problem() -> None:
    case = next(c for c in REFUSAL_CASES if c.name == "unknown_tool")
    good = {"message": 'tool_choice names "launch_rocket", not one of get_weather', "type": "x"}
    assert check_refusal(400, good, case) is None
    assert "expected 400" in (check_refusal(500, good, case) or "")
    assert "shape" in (check_refusal(400, "Bad Request", case) or "")
    vague = {"message": "tool_choice is not valid", "type": "invalid_request_error"}
    assert "launch_rocket" in (check_refusal(400, vague, case) or "")
    assert all(c.mentions for c in REFUSAL_CASES)
