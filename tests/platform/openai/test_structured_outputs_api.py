"""Structured output through the API: every spelling of a constraint (OpenAI's response_format,
vLLM's structured_outputs and guided_* fields) reaches the engine as one
``StructuredOutputsParams``; two constraints, oversized ones, and schemas or grammars the
backend cannot enforce are 400s naming the field, and the engine sees nothing of them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from loraplex.grammar import MAX_CHOICES, MAX_REGEX_CHARS, MAX_SCHEMA_CHARS
from loraplex.platform.openai.structured import MAX_SCHEMA_DEPTH
from loraplex.sampling_params import StructuredOutputsParams
from tests.utils.scripted import ScriptedAPI, scripted_api, smollm2_dir

pytestmark = pytest.mark.anyio

MODEL = "SmolLM2-135M-Instruct"  # the served name: the model directory's
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Give me a person."}]}
COMPLETION = {"model": MODEL, "prompt": "A person as JSON:"}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
BODIES = {"chat": CHAT, "completions": COMPLETION}


@pytest.fixture
async def api(smollm2: Any) -> AsyncIterator[ScriptedAPI]:
    async with scripted_api(smollm2, smollm2_dir()) as api:
        api.say('{"name": "Ada", "age": 36}')
        yield api


async def _sent(api: ScriptedAPI, endpoint: str, **fields: Any) -> StructuredOutputsParams | None:
    r = await api.http.post(PATHS[endpoint], json={**BODIES[endpoint], **fields})
    assert r.status_code == 200, r.text
    return api.submitted[-1].params.structured_outputs


def _error(r: Any) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    return dict(r.json()["error"])


# ---- mapping -----------------------------------------------------------------------------------

SPELLINGS: list[tuple[dict[str, Any], StructuredOutputsParams]] = [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON},
            }
        },
        StructuredOutputsParams(json=PERSON),
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON, "strict": True, "description": "x"},
            }
        },
        StructuredOutputsParams(json=PERSON),
    ),
    ({"structured_outputs": {"json": PERSON}}, StructuredOutputsParams(json=PERSON)),
    ({"structured_outputs": {"json": json.dumps(PERSON)}}, StructuredOutputsParams(json=PERSON)),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
    ({"structured_outputs": {"regex": "[a-z]{3}"}}, StructuredOutputsParams(regex="[a-z]{3}")),
    (
        {"structured_outputs": {"choice": ["yes", "no"]}},
        StructuredOutputsParams(choice=("yes", "no")),
    ),
    (
        {"structured_outputs": {"grammar": 'start: "a" | "b"'}},
        StructuredOutputsParams(grammar='start: "a" | "b"'),
    ),
    (
        {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
        StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
    ),
    (  # vLLM's clients send every key, unset ones as null
        {"structured_outputs": {"json": None, "regex": "x+", "choice": None, "grammar": None}},
        StructuredOutputsParams(regex="x+"),
    ),
    ({"guided_json": PERSON}, StructuredOutputsParams(json=PERSON)),
    ({"guided_json": json.dumps(PERSON)}, StructuredOutputsParams(json=PERSON)),
    ({"guided_regex": "[a-z]{3}"}, StructuredOutputsParams(regex="[a-z]{3}")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=("yes", "no"))),
    ({"guided_grammar": 'start: "a"'}, StructuredOutputsParams(grammar='start: "a"')),
    ({"guided_regex": "a", "guided_decoding_backend": "auto"}, StructuredOutputsParams(regex="a")),
]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(("fields", "expected"), SPELLINGS)
async def test_each_spelling_reaches_the_engine_as_one_constraint(
    api: ScriptedAPI, endpoint: str, fields: dict[str, Any], expected: StructuredOutputsParams
) -> None:
    assert await _sent(api, endpoint, **fields) == expected


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_no_constraint_and_text_format_send_none(api: ScriptedAPI, endpoint: str) -> None:
    assert await _sent(api, endpoint) is None
    assert await _sent(api, endpoint, response_format={"type": "text"}) is None
    assert await _sent(api, endpoint, guided_json=None, structured_outputs=None) is None


async def test_the_answer_is_the_json_the_model_wrote(api: ScriptedAPI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = await api.http.post(PATHS["chat"], json={**CHAT, "response_format": fmt})
    choice = r.json()["choices"][0]
    assert json.loads(choice["message"]["content"]) == {"name": "Ada", "age": 36}
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]


# ---- conflicts -------------------------------------------------------------------------------

CONFLICTS = [
    (
        {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
        ("response_format", "guided_regex"),
    ),
    (
        {"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]},
        ("structured_outputs.regex", "guided_choice"),
    ),
    ({"guided_json": PERSON, "guided_grammar": 'start: "a"'}, ("guided_json", "guided_grammar")),
    (
        {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
        ("structured_outputs.regex", "structured_outputs.choice"),
    ),
    (
        {
            "response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}},
            "structured_outputs": {"json": PERSON},
        },
        ("response_format.json_schema.schema", "structured_outputs.json"),
    ),
]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(("fields", "names"), CONFLICTS)
async def test_two_constraints_are_a_400_naming_both(
    api: ScriptedAPI, endpoint: str, fields: dict[str, Any], names: tuple[str, str]
) -> None:
    r = await api.http.post(PATHS[endpoint], json={**BODIES[endpoint], **fields})
    error = _error(r)
    assert error["code"] == "conflicting_constraints"
    assert names[0] in error["message"] and names[1] in error["message"], error
    assert api.submitted == []


# ---- bounds and malformed constraints ------------------------------------------------------------


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BIG_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "string", "description": "x" * 100} for i in range(700)},
}
BAD: list[tuple[dict[str, Any], str, str, str]] = [
    # (fields, param, code, words of the message)
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": BIG_SCHEMA}}},
        "response_format.json_schema.schema",
        "schema_too_large",
        f"at most {MAX_SCHEMA_CHARS:,}",
    ),
    (
        {"guided_json": _deep(MAX_SCHEMA_DEPTH)},
        "guided_json",
        "schema_too_deep",
        f"at most {MAX_SCHEMA_DEPTH}",
    ),
    (
        {"structured_outputs": {"regex": "a" * (MAX_REGEX_CHARS + 1)}},
        "structured_outputs.regex",
        "regex_too_long",
        f"at most {MAX_REGEX_CHARS:,}",
    ),
    (
        {"guided_choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]},
        "guided_choice",
        "too_many_choices",
        f"at most {MAX_CHOICES:,}",
    ),
    (
        {"guided_choice": ["x" * 40_000, "y" * 40_000]},
        "guided_choice",
        "choices_too_long",
        "characters in all",
    ),
    ({"guided_grammar": "x" * 70_000}, "guided_grammar", "grammar_too_long", "at most 64,000"),
    ({"guided_choice": []}, "guided_choice", "invalid_type", "non-empty list"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice", "invalid_type", ""),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "invalid_schema", ""),
    ({"guided_json": "{not json"}, "guided_json", "invalid_schema", "not valid JSON"),
    ({"guided_json": "[" * 50_000}, "guided_json", "schema_too_deep", "levels deep"),
    ({"structured_outputs": {}}, "structured_outputs", "missing_constraint", "give one of"),
    (
        {"structured_outputs": {"regexp": "a"}},
        "structured_outputs.regexp",
        "invalid_value",
        "not a field",
    ),
    (
        {"structured_outputs": {"structural_tag": "{}"}},
        "structured_outputs.structural_tag",
        "unsupported_parameter",
        "structural tags",
    ),
    (
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema",
        "missing_schema",
        "needs its json_schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
        "missing_schema",
        'has no "schema"',
    ),
    (
        {"response_format": {"type": "yaml"}},
        "response_format.type",
        "invalid_value",
        "'json_schema'",
    ),
    (
        {"response_format": {"type": "structural_tag"}},
        "response_format.type",
        "unsupported_parameter",
        "not supported",
    ),
    (
        {"guided_regex": "a", "guided_decoding_backend": "xgrammar"},
        "guided_decoding_backend",
        "unsupported_parameter",
        "llguidance",
    ),
]


@pytest.mark.parametrize(("fields", "param", "code", "words"), BAD)
async def test_malformed_or_oversized_constraints_are_400s_before_the_engine(
    api: ScriptedAPI, fields: dict[str, Any], param: str, code: str, words: str
) -> None:
    for endpoint in ("chat", "completions"):
        r = await api.http.post(PATHS[endpoint], json={**BODIES[endpoint], **fields})
        error = _error(r)
        assert (error["param"], error["code"]) == (param, code), error
        assert words in error["message"], error["message"]
    assert api.submitted == []


UNENFORCEABLE = [
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"properties": {"a": {"$ref": "#/$defs/missing"}}},
                },
            }
        },
        "/$defs/missing",
    ),
    ({"structured_outputs": {"regex": "(unclosed"}}, "unclosed group"),
    ({"guided_grammar": "start: undefined_rule"}, "undefined_rule"),
]


@pytest.mark.parametrize(("fields", "words"), UNENFORCEABLE)
async def test_a_constraint_the_backend_refuses_is_a_400_naming_why(
    api: ScriptedAPI, fields: dict[str, Any], words: str
) -> None:
    r = await api.http.post(PATHS["chat"], json={**CHAT, **fields})
    error = _error(r)
    assert words in error["message"], error["message"]
    assert error["code"].startswith("invalid_"), error
    assert api.submitted == []  # refused before the engine


async def test_the_compile_runs_off_the_event_loop(
    api: ScriptedAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from loraplex.grammar.llg import LLGuidanceBackend

    seen: list[bool] = []
    real = LLGuidanceBackend.compile

    def spy(self: LLGuidanceBackend, constraint: StructuredOutputsParams) -> Any:
        seen.append(threading.current_thread() is threading.main_thread())
        return real(self, constraint)

    monkeypatch.setattr(LLGuidanceBackend, "compile", spy)
    await _sent(api, "chat", guided_regex="[0-9]+")
    assert seen == [False]


# ---- the official client ---------------------------------------------------------------------


async def test_official_client_parse_with_a_pydantic_model(api: ScriptedAPI) -> None:
    import openai
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=api.http)
    done = await client.chat.completions.parse(
        model=MODEL, messages=CHAT["messages"], response_format=Person, max_tokens=64
    )
    assert done.choices[0].message.parsed == Person(name="Ada", age=36)
    sent = api.submitted[-1].params.structured_outputs
    assert sent is not None and sent.json is not None
    schema = dict(sent.json)  # what the client sends for a pydantic model: a strict schema
    assert schema["required"] == ["name", "age"] and schema["additionalProperties"] is False


# ---- a constraint failing in the engine ------------------------------------------------------


async def test_a_constraint_failing_in_the_engine_is_a_server_error(api: ScriptedAPI) -> None:
    """The engine ends the sample with finish_reason "error" (its matcher failed): a 500 that
    says so, or a last error event of a stream; the next request is served."""
    from tests.utils.app import sse_events

    api.engine.error_after = 3
    body = {**CHAT, "guided_regex": "[a-z ]+"}
    r = await api.http.post(PATHS["chat"], json=body)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "structured_output_failed" and "matcher failed" in error["message"]
    r = await api.http.post(PATHS["chat"], json={**body, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "structured_output_failed"
    api.engine.error_after = None
    r = await api.http.post(PATHS["chat"], json=body)
    assert r.status_code == 200, r.text


async def test_official_client_parse_with_nested_models(api: ScriptedAPI) -> None:
    """A strict schema with $defs/$ref, enums, nullable fields and arrays compiles, and the
    answer parses back into the models."""
    from enum import Enum

    import openai
    from pydantic import BaseModel

    class Role(str, Enum):
        admin = "admin"
        user = "user"

    class Address(BaseModel):
        city: str
        zip: str | None

    class Account(BaseModel):
        name: str
        role: Role
        addresses: list[Address]

    api.say('{"name": "Ada", "role": "admin", "addresses": [{"city": "London", "zip": null}]}')
    client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=api.http)
    done = await client.chat.completions.parse(
        model=MODEL, messages=CHAT["messages"], response_format=Account
    )
    assert done.choices[0].message.parsed == Account(
        name="Ada", role=Role.admin, addresses=[Address(city="London", zip=None)]
    )
    sent = api.submitted[-1].params.structured_outputs
    assert sent is not None and "$defs" in dict(sent.json or {})
