"""Constraints that cannot be satisfied or compiled are client faults (issue 31 point 6): a 400
``invalid_constraint`` naming the request's field and the part of it (schema path, regex, rule),
with none of the grammar library's internals, before the engine sees anything; the check is
bounded (issue 31 point 1: the 40-pattern allOf) and its threads are shared fairly between
tenants (point 4). Before: these ten compiled (or, for allOf, ran for minutes growing by GBs),
and failed in the engine with a 500 ``structured_output_failed`` holding the parser's state."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.grammar import GrammarBackend, LLGuidanceBackend
from loraplex.platform.errors import APIError
from loraplex.platform.openai.structured import Constraint, ConstraintChecker
from loraplex.sampling_params import StructuredOutputsParams as SO
from tests.utils.grammar_attacks import CASES, INTERNALS, rss_mb
from tests.utils.scripted import ScriptedAPI, scripted_api, smollm2_dir
from tests.utils.structured import write_byte_tokenizer

pytestmark = pytest.mark.anyio

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Go."}]}


@pytest.fixture
async def api(smollm2: Any) -> AsyncIterator[ScriptedAPI]:
    async with scripted_api(smollm2, smollm2_dir()) as api:
        api.say("x")
        yield api


def _fields(constraint: SO) -> tuple[dict[str, Any], str]:
    """The request fields that send ``constraint``, and the param its error names."""
    if constraint.kind == "json":
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": constraint.json}}
        return {"response_format": fmt}, "response_format.json_schema.schema"
    if constraint.kind == "regex":
        return {"guided_regex": constraint.regex}, "guided_regex"
    return {"structured_outputs": {"grammar": constraint.grammar}}, "structured_outputs.grammar"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(CASES))
async def test_each_unsatisfiable_or_runaway_constraint_is_a_clean_400(
    api: ScriptedAPI, name: str
) -> None:
    constraint, words = CASES[name]
    fields, param = _fields(constraint)
    before = rss_mb()
    start = time.perf_counter()
    r = await api.http.post("/v1/chat/completions", json={**CHAT, **fields})
    seconds = time.perf_counter() - start
    grown = rss_mb() - before
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "invalid_constraint",
        param,
        "invalid_request_error",
    )
    message = error["message"]
    assert message.startswith(f"{param}: ") and words in message, message
    assert not [bad for bad in INTERNALS if bad in message], message
    assert seconds < 2.0 and grown < 200, (seconds, grown)  # the API process's time and RSS
    assert api.submitted == []


async def test_x_guidance_in_a_schema_or_a_tool_is_refused_by_path(api: ScriptedAPI) -> None:
    sneaky = {"type": "object", "properties": {"a": {"type": "strin"}}}
    sneaky["x-guidance"] = {"lenient": True, "whitespace_pattern": r"\s*"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": sneaky}}
    r = await api.http.post("/v1/chat/completions", json={**CHAT, "response_format": fmt})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_constraint"
    assert "x-guidance at the root" in error["message"]
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"q": {"x-guidance": {}}}},
        },
    }
    body = {**CHAT, "tools": [tool], "tool_choice": "required"}
    r = await api.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools[0].function.parameters"
    assert "x-guidance at /properties/q" in error["message"]
    grammar = 'start: x\nx: %json {"type": "object", "x-guidance": {"lenient": true}}'
    r = await api.http.post(
        "/v1/chat/completions", json={**CHAT, "structured_outputs": {"grammar": grammar}}
    )
    assert r.status_code == 400 and "x-guidance.lenient" in r.json()["error"]["message"]
    assert api.submitted == []


class HeldBackend:
    """The real backend, but compiling a constraint whose key holds ``SLOW`` waits for
    ``gate`` (a stand-in for a 13-second 70-tool compile)."""

    def __init__(self, inner: LLGuidanceBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.vocab_size = inner.vocab_size
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)

    def compile(self, constraint: SO) -> Any:
        if "SLOW" in constraint.key():
            self.started.release()
            assert self.gate.wait(10)
        return self.inner.compile(constraint)

    def fill_bitmasks(self, matchers: Any, bitmask: Any) -> None:
        self.inner.fill_bitmasks(matchers, bitmask)


async def test_one_tenants_slow_checks_do_not_delay_another_tenants(tmp_path: Path) -> None:
    """Tenant a's two held checks hold one of the two check threads; tenant b's json_object
    is answered meanwhile. Before (one limiter for all): b waited for a's compiles."""
    import anyio
    from transformers import AutoTokenizer

    write_byte_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    held: list[HeldBackend] = []

    def backend(tok: Any) -> GrammarBackend:
        held.append(HeldBackend(LLGuidanceBackend(tok)))
        return held[-1]

    checker = ConstraintChecker(2, backend=backend)
    warm = Constraint(SO(regex="[a-z]"), "guided_regex")
    await checker.check(warm, tokenizer, "b")  # the backend is built once
    slow = [Constraint(SO(json={"type": "object", "title": f"SLOW {i}"}), "tools") for i in (1, 2)]
    async with anyio.create_task_group() as tg:
        for c in slow:
            tg.start_soon(checker.check, c, tokenizer, "a")
        await anyio.to_thread.run_sync(held[0].started.acquire)  # a's first compile is held
        start = time.perf_counter()
        with anyio.fail_after(5):
            await checker.check(Constraint(SO(json_object=True), "response_format"), tokenizer, "b")
        waited = time.perf_counter() - start
        held[0].gate.set()
    assert waited < 1.0, waited
    with pytest.raises(APIError) as info:
        await checker.check(Constraint(SO(regex="a{20000}"), "guided_regex"), tokenizer, "b")
    assert info.value.code == "invalid_constraint" and "a{20000}" in info.value.message
    checker.shutdown()
