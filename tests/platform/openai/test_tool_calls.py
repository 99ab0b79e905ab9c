"""Tool calling: the parser of each format (whole, malformed, several calls, streamed deltas that
join into the same calls), the chat endpoint's tool_calls and finish_reason, streamed and not,
the grammar of tool_choice required/named (it embeds each tool's schema, so arguments validate),
tools and tool results through the chat template (SmolLM2's, which has no tool support, and a
Qwen-style one that renders tools itself), the 400s, and the official client."""

from __future__ import annotations

import json
import random
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.platform.openai.tools.formats import HERMES, SMOLLM2, template_tools
from loraplex.platform.openai.tools.parser import ToolCallParser, parse_answer
from loraplex.platform.openai.tools.request import MAX_TOOLS
from tests.utils.app import sse_events
from tests.utils.scripted import (
    QWEN_TEMPLATE,
    ScriptedAPI,
    scripted_api,
    smollm2_dir,
    tokenizer_copy,
)

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def _join(deltas: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Streamed tool_calls deltas joined as a client does: by index."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": "", "name": "", "arguments": ""})
        if "id" in d:
            assert not call["id"], "a call is announced once"
            assert d["type"] == "function" and d["function"]["arguments"] == ""
            call["id"], call["name"] = d["id"], d["function"]["name"]
        else:
            assert call["id"], "the name comes first"
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        call["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


# ---- the parser ------------------------------------------------------------------------------

HERMES_TWO = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } and \\" and </x>"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
SMOLLM2_TWO = (
    '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"zone": ["UTC", {"x": 1}]}}]</tool_call>'
)
PARSED: list[tuple[str, str, list[tuple[str, Any]]]] = [
    # (answer, its content, its calls (name, arguments))
    (
        HERMES_TWO,
        "Let me check.",
        [("get_weather", {"city": "Paris", "note": 'a } and " and </x>'}), ("get_time", {})],
    ),
    (
        SMOLLM2_TWO,
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": ["UTC", {"x": 1}]})],
    ),
    (SMOLLM2.render_calls([("f", {"a": 1})]), "", [("f", {"a": 1})]),
    (HERMES.render_calls([("f", {"a": 1}), ("g", {})]), "", [("f", {"a": 1}), ("g", {})]),
    # keys in another order, "parameters", arguments as JSON text: read whole at the block's end
    ('<tool_call>{"arguments": {"q": 1}, "name": "f"}</tool_call>', "", [("f", {"q": 1})]),
    ('<tool_call>{"name": "f", "parameters": {"q": 1}}</tool_call>', "", [("f", {"q": 1})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>', "", [("f", {"q": 1})]),
    # unterminated (the model stopped after the JSON)
    ('<tool_call>\n{"name": "f", "arguments": {"q": 1}}', "", [("f", {"q": 1})]),
    # malformed: the text stays content, as written
    (
        "Hi <tool_call>{not json}</tool_call> there",
        "Hi <tool_call>{not json}</tool_call> there",
        [],
    ),
    ('<tool_call>{"name": "f", "arguments": {"q": }}</tool_call>', None, []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (
        '<tool_call>\n{"name": "f", "arguments": {"q": 1',
        '<tool_call>\n{"name": "f", "arguments": {"q": 1',
        [],
    ),
    # arguments nested too deep to read: not a call
    (
        '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>",
        None,
        [],
    ),
    # no calls: the text, whitespace and a partial tag included
    ("Plain answer.\n", "Plain answer.\n", []),
    ("a <tool_ca", "a <tool_ca", []),
    ("", "", []),
    ("<tool_call>[]</tool_call>", "", []),
]


def _short(value: Any) -> str | None:
    """Test ids: a long answer by its start and length."""
    return f"{value[:40]}...({len(value)})" if isinstance(value, str) and len(value) > 60 else None


@pytest.mark.parametrize(("text", "content", "calls"), PARSED, ids=_short)
def test_a_whole_answer_parses_into_content_and_calls(
    text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    got_content, got = parse_answer(text)
    if content is not None:
        assert got_content == content
    else:  # malformed: the block is content
        assert got_content == text
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(CALL_ID.fullmatch(c.id) for c in got)
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("text", [t for t, _, calls in PARSED if calls], ids=_short)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_deltas_join_into_the_same_calls(text: str, seed: int) -> None:
    """Whatever the chunking (one character at a time, random pieces), the deltas join into
    the calls and the content of the whole answer."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 30))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    if seed == 0:
        pieces = list(text)
    parser = ToolCallParser()
    content, deltas = "", []
    for piece in pieces:
        out = parser.push(piece)
        content += out.content
        deltas += [d for d in out.calls]
    out = parser.finish()
    content += out.content
    deltas += out.calls
    raw = [
        {
            "index": d.index,
            "id": d.id,
            "type": "function",
            "function": {"name": d.name, "arguments": d.arguments},
        }
        if d.id
        else {"index": d.index, "function": {"arguments": d.arguments}}
        for d in deltas
    ]
    whole_content, whole = parse_answer(text)
    joined = _join(raw)
    assert [(c["name"], c["arguments"]) for c in joined] == [(c.name, c.arguments) for c in whole]
    assert content == whole_content


def test_the_name_is_announced_before_the_arguments_end() -> None:
    parser = ToolCallParser()
    head = parser.push('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(d.name, d.arguments) for d in head.calls] == [("get_weather", ""), (None, '{"ci')]
    more = parser.push('ty": "Paris"}}\n</tool_call>')
    assert [d.arguments for d in more.calls] == ['ty": "Paris"}']
    assert parser.valid_calls[0].arguments == '{"city": "Paris"}'


def test_one_call_when_parallel_calls_are_off() -> None:
    _, calls = parse_answer(HERMES_TWO, max_calls=1)
    assert [c.name for c in calls] == ["get_weather"]


# ---- the endpoint --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tokenizer_copy(tmp_path_factory.mktemp("tok") / "qwen-style", QWEN_TEMPLATE)


@pytest.fixture(scope="module")
def qwen(qwen_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


@pytest.fixture
async def smol_api(smollm2: Any) -> AsyncIterator[ScriptedAPI]:
    async with scripted_api(smollm2, smollm2_dir()) as api:
        yield api


@pytest.fixture
async def qwen_api(qwen: Any, qwen_dir: str) -> AsyncIterator[ScriptedAPI]:
    async with scripted_api(qwen, qwen_dir) as api:
        yield api


def test_each_template_gets_its_format(smollm2: Any, qwen: Any) -> None:
    assert template_tools(smollm2.chat_template).format is SMOLLM2
    assert not template_tools(smollm2.chat_template).native  # SmolLM2's has no tool support
    assert template_tools(qwen.chat_template).format is HERMES
    assert template_tools(qwen.chat_template).native


def _body(api: ScriptedAPI, **fields: Any) -> dict[str, Any]:
    model = Path(api.engine.model_dir).name
    return {"model": model, "messages": USER, "tools": TOOLS, "max_tokens": 200, **fields}


def _answers(fmt_api: str) -> str:
    calls = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]
    return (SMOLLM2 if fmt_api == "smol" else HERMES).render_calls(calls)


@pytest.mark.parametrize("which", ["smol", "qwen"])
async def test_calls_come_back_as_tool_calls_streamed_or_not(
    which: str, smol_api: ScriptedAPI, qwen_api: ScriptedAPI
) -> None:
    api = smol_api if which == "smol" else qwen_api
    api.say(_answers(which))
    r = await api.http.post("/v1/chat/completions", json=_body(api))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"]) for c in calls] == [
        ("function", "get_weather"),
        ("function", "get_time"),
    ]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert all(CALL_ID.fullmatch(c["id"]) for c in calls)
    assert api.submitted[-1].params.structured_outputs is None  # auto: the model chooses

    r = await api.http.post("/v1/chat/completions", json=_body(api, stream=True))
    events = [e for e in sse_events(r.text) if e != "[DONE]"]
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
    joined = _join(deltas)
    assert [(c["name"], c["arguments"]) for c in joined] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert len(deltas) > 4  # arguments come in fragments
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(e["choices"][0]["delta"].get("content") for e in events)


async def test_text_answers_stay_text_under_auto(smol_api: ScriptedAPI) -> None:
    smol_api.say("It is sunny in Paris.")
    r = await smol_api.http.post("/v1/chat/completions", json=_body(smol_api))
    choice = r.json()["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "It is sunny in Paris.",
    }
    assert choice["finish_reason"] == "stop"


async def test_text_before_a_call_is_content(qwen_api: ScriptedAPI) -> None:
    qwen_api.say("Checking.\n" + HERMES.render_calls([("get_time", {})]))
    r = await qwen_api.http.post("/v1/chat/completions", json=_body(qwen_api))
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "Checking."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    r = await qwen_api.http.post("/v1/chat/completions", json=_body(qwen_api, stream=True))
    content = "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in sse_events(r.text)
        if e != "[DONE]" and e["choices"]
    )
    assert content == "Checking."


async def test_a_malformed_call_is_content_and_finishes_stop(qwen_api: ScriptedAPI) -> None:
    qwen_api.say('<tool_call>\n{"name": "get_time", "arguments": {oops}}\n</tool_call>')
    r = await qwen_api.http.post("/v1/chat/completions", json=_body(qwen_api))
    choice = r.json()["choices"][0]
    assert "tool_calls" not in choice["message"]  # absent, as OpenAI answers
    assert choice["message"]["content"].startswith("<tool_call>")
    assert choice["finish_reason"] == "stop"


async def test_a_call_cut_by_max_tokens_finishes_length(qwen_api: ScriptedAPI) -> None:
    qwen_api.say(_answers("qwen"))
    r = await qwen_api.http.post("/v1/chat/completions", json=_body(qwen_api, max_tokens=8))
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_parallel_tool_calls_false_gives_one_call(qwen_api: ScriptedAPI) -> None:
    qwen_api.say(_answers("qwen"))
    r = await qwen_api.http.post(
        "/v1/chat/completions", json=_body(qwen_api, parallel_tool_calls=False)
    )
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


async def test_every_sample_is_parsed(qwen_api: ScriptedAPI) -> None:
    qwen_api.say(HERMES.render_calls([("get_time", {})]), "No call.")
    r = await qwen_api.http.post("/v1/chat/completions", json=_body(qwen_api, n=2))
    choices = r.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["tool_calls", "stop"]
    assert choices[1]["message"]["content"] == "No call."


# ---- required and named: the grammar ----------------------------------------------------------


_LL_TOKENIZERS: dict[int, Any] = {}


def _matches(tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether ``grammar`` accepts ``text`` as a whole answer (llguidance, as the engine)."""
    import llguidance
    import llguidance.hf

    if id(tokenizer) not in _LL_TOKENIZERS:
        _LL_TOKENIZERS[id(tokenizer)] = llguidance.hf.from_tokenizer(tokenizer)
    matcher = llguidance.LLMatcher(
        _LL_TOKENIZERS[id(tokenizer)], llguidance.LLMatcher.grammar_from_lark(grammar)
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return matcher.validate_tokens(ids) == len(ids) and (
        matcher.consume_tokens(ids) and matcher.is_accepting()
    )


@pytest.mark.parametrize("which", ["smol", "qwen"])
async def test_required_sends_a_grammar_that_embeds_each_tools_schema(
    which: str, smol_api: ScriptedAPI, qwen_api: ScriptedAPI, smollm2: Any
) -> None:
    api = smol_api if which == "smol" else qwen_api
    fmt = SMOLLM2 if which == "smol" else HERMES
    api.say(_answers(which))
    r = await api.http.post("/v1/chat/completions", json=_body(api, tool_choice="required"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    constraint = api.submitted[-1].params.structured_outputs
    assert constraint is not None and constraint.grammar is not None
    grammar = constraint.grammar
    assert grammar.count("%json") == 2
    assert json.dumps(WEATHER["function"]["parameters"]["properties"]) in grammar
    good = [("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert _matches(smollm2, grammar, fmt.render_calls(good))
    assert _matches(smollm2, grammar, fmt.render_calls(good[:1]))
    for bad in (
        [("get_weather", {"town": "Rome"})],  # not in the schema (additionalProperties false)
        [("get_weather", {"city": "Rome", "unit": "kelvin"})],  # not in the enum
        [("get_weather", {})],  # city is required
        [("delete_everything", {})],  # not a tool
    ):
        assert not _matches(smollm2, grammar, fmt.render_calls(bad)), bad
    assert not _matches(smollm2, grammar, "Just text.")


async def test_a_named_choice_allows_exactly_one_call_of_that_tool(
    qwen_api: ScriptedAPI, qwen: Any
) -> None:
    qwen_api.say(HERMES.render_calls([("get_weather", {"city": "Rome"})]))
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = await qwen_api.http.post("/v1/chat/completions", json=_body(qwen_api, tool_choice=choice))
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Rome"}]
    constraint = qwen_api.submitted[-1].params.structured_outputs
    assert constraint is not None and constraint.grammar is not None
    grammar = constraint.grammar
    assert "get_time" not in grammar
    assert _matches(qwen, grammar, HERMES.render_calls([("get_weather", {"city": "Rome"})]))
    two = [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})]
    assert not _matches(qwen, grammar, HERMES.render_calls(two))
    assert not _matches(qwen, grammar, HERMES.render_calls([("get_time", {})]))


async def test_auto_with_a_json_response_format_allows_calls_or_the_json(
    qwen_api: ScriptedAPI, qwen: Any
) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    qwen_api.say('{"answer": "sunny"}')
    r = await qwen_api.http.post("/v1/chat/completions", json=_body(qwen_api, response_format=fmt))
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"answer": "sunny"}
    constraint = qwen_api.submitted[-1].params.structured_outputs
    assert constraint is not None and constraint.grammar is not None
    assert _matches(qwen, constraint.grammar, '{"answer": "sunny"}')
    assert _matches(qwen, constraint.grammar, HERMES.render_calls([("get_time", {})]))
    assert not _matches(qwen, constraint.grammar, '{"other": 1}')


async def test_a_tool_schema_the_backend_refuses_is_a_400_before_the_engine(
    qwen_api: ScriptedAPI,
) -> None:
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}},
        },
    }
    r = await qwen_api.http.post(
        "/v1/chat/completions", json=_body(qwen_api, tools=[bad], tool_choice="required")
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("tools", "invalid_constraint")
    assert "strin" in error["message"] and "parameter schemas" in error["message"]
    assert qwen_api.submitted == []


# ---- the conversation through the template --------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "user", "content": "Thanks. And Rome?"},
]


async def test_tool_messages_go_through_smollm2s_template(
    smol_api: ScriptedAPI, smollm2: Any
) -> None:
    smol_api.say("Sunny.")
    r = await smol_api.http.post(
        "/v1/chat/completions", json=_body(smol_api, messages=CONVERSATION)
    )
    assert r.status_code == 200, r.text
    prompt = smollm2.decode(smol_api.submitted[-1].prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nYou are an expert in composing functions.")
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt  # the tools, in the system turn
    assert (
        '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}]</tool_call><|im_end|>'
    ) in prompt
    assert (
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>"
    ) in prompt
    assert prompt.endswith("Thanks. And Rome?<|im_end|>\n<|im_start|>assistant\n")


async def test_tool_messages_go_through_a_template_that_knows_tools(
    qwen_api: ScriptedAPI, qwen: Any
) -> None:
    qwen_api.say("Sunny.")
    r = await qwen_api.http.post(
        "/v1/chat/completions", json=_body(qwen_api, messages=CONVERSATION)
    )
    assert r.status_code == 200, r.text
    prompt = qwen.decode(qwen_api.submitted[-1].prompt_token_ids)
    assert "# Tools" in prompt and json.dumps(WEATHER) in prompt  # rendered by the template
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


async def test_tool_choice_none_hides_the_tools(smol_api: ScriptedAPI, smollm2: Any) -> None:
    smol_api.say(SMOLLM2.render_calls([("get_time", {})]))
    r = await smol_api.http.post("/v1/chat/completions", json=_body(smol_api, tool_choice="none"))
    choice = r.json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert "<tools>" not in smollm2.decode(smol_api.submitted[-1].prompt_token_ids)


async def test_earlier_calls_without_tools_still_render(smol_api: ScriptedAPI) -> None:
    smol_api.say("ok")
    body = _body(smol_api, messages=CONVERSATION)
    del body["tools"]
    r = await smol_api.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


# ---- 400s ------------------------------------------------------------------------------------------


def _tool(name: str, parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": [_tool(f"t{i}") for i in range(MAX_TOOLS + 1)]}, "tools", "too_many_tools"),
    ({"tools": [_tool("bad name")]}, "tools[0].function.name", "invalid_tool_name"),
    ({"tools": [_tool("x" * 65)]}, "tools[0].function.name", "invalid_tool_name"),
    ({"tools": [_tool("a"), _tool("a")]}, "tools[1].function.name", "duplicate_tool_name"),
    (
        {"tools": [{"type": "retrieval", "function": {"name": "a"}}]},
        "tools[0].type",
        "invalid_value",
    ),
    ({"tools": [_tool("a", {"type": "array"})]}, "tools[0].function.parameters", "invalid_schema"),
    (
        {"tools": [_tool("a", {"type": "object", "description": "x" * 70_000})]},
        "tools[0].function.parameters",
        "schema_too_large",
    ),
    (
        {
            "tools": [
                _tool(f"t{i}", {"type": "object", "description": "x" * 30_000}) for i in range(10)
            ]
        },
        "tools",
        "tools_too_large",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "a", "description": "d" * 5000}}]},
        "tools[0].function.description",
        "description_too_long",
    ),
    ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    (
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
        "unknown_tool",
    ),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "missing_tools"),
    (
        {"tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "conflicting_constraints",
    ),
    ({"guided_regex": "[a-z]+"}, "guided_regex", "conflicting_constraints"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    (
        {"messages": [{"role": "tool", "content": "x"}]},
        "messages[0].tool_call_id",
        "missing_tool_call_id",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{bad"}}],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
        "invalid_tool_call",
    ),
    (  # nested too deep to read (a RecursionError in json.loads): a 400 as well
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "function": {"name": "f", "arguments": "[" * 50_000}}
                    ],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
        "invalid_tool_call",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}
            ]
        },
        "messages[0].tool_calls",
        "invalid_value",
    ),
]


@pytest.mark.parametrize(("fields", "param", "code"), REFUSED, ids=lambda v: None)
async def test_bad_tools_are_400s_naming_the_field(
    qwen_api: ScriptedAPI, fields: dict[str, Any], param: str, code: str
) -> None:
    r = await qwen_api.http.post("/v1/chat/completions", json=_body(qwen_api, **fields))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert qwen_api.submitted == []


# ---- the official client ---------------------------------------------------------------------


async def test_official_client_tools_streamed_and_parsed(qwen_api: ScriptedAPI) -> None:
    import openai
    from pydantic import BaseModel

    class GetWeather(BaseModel):
        city: str

    client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=qwen_api.http)
    qwen_api.say(HERMES.render_calls([("GetWeather", {"city": "Oslo"})]))
    model = Path(qwen_api.engine.model_dir).name
    done = await client.chat.completions.parse(
        model=model,
        messages=USER,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
    )
    [call] = done.choices[0].message.tool_calls or []
    assert call.function.parsed_arguments == GetWeather(city="Oslo")
    assert done.choices[0].finish_reason == "tool_calls"

    async with client.chat.completions.stream(
        model=model,
        messages=USER,
        tools=[openai.pydantic_function_tool(GetWeather)],
    ) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls or []
    assert streamed.function.name == "GetWeather"
    assert streamed.function.parsed_arguments == GetWeather(city="Oslo")


async def test_an_unknown_tool_choice_is_named_once_quoted(qwen_api: ScriptedAPI) -> None:
    choice = {"type": "function", "function": {"name": "launch_rocket"}}
    r = await qwen_api.http.post("/v1/chat/completions", json=_body(qwen_api, tool_choice=choice))
    message = r.json()["error"]["message"]
    assert "function 'launch_rocket', which" in message, message
