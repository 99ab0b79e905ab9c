"""The Playground's "JSON schema" box: an optional schema applied to both sides (base and
adapter), without scripts and streamed; a schema that is not JSON, too large, or one the
grammar backend cannot enforce is an inline error on the field, and nothing runs.

The tiny model's word-level tokenizer cannot carry a grammar (it has no ``{``), so these runs use
a byte-level tokenizer within the tiny model's vocabulary (``tests/utils/structured.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.grammar import MAX_SCHEMA_CHARS
from loraplex.sampling_params import StructuredOutputsParams
from tests.utils import registry as rf
from tests.utils.app import add_chat_template
from tests.utils.registry_web import build_web, create_tenant, field_errors, upload_through_form
from tests.utils.structured import write_byte_tokenizer
from tests.utils.web import WebEnv, csrf_of, sign_in

pytestmark = pytest.mark.anyio
registry_models = rf.registry_models

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer"],
}


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok") / "bytes"
    write_byte_tokenizer(path)
    add_chat_template(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture
def web(
    tmp_path: Path, registry_models: rf.RegistryModels, byte_tokenizer: Any
) -> Iterator[WebEnv]:
    env = build_web(tmp_path, registry_models, byte_tokenizer)
    create_tenant(env, "acme")
    try:
        yield env
    finally:
        env.close()


async def _signed_in(http: Any, models: rf.RegistryModels) -> str:
    await sign_in(http)
    r = await upload_through_form(http, "acme", "bot", models.adapters["a"].files())
    assert r.status_code == 303, r.text[:400]
    page = await http.get("/admin/playground", params={"tenant": "acme"})
    assert page.status_code == 200
    assert 'name="schema"' in page.text and "JSON schema (optional)" in page.text
    return csrf_of(page.text)


def _form(csrf: str, **fields: str) -> dict[str, str]:
    values = {
        "csrf_token": csrf, "tenant": "acme", "model": "bot", "prompt": "Is it sunny?",
        "max_tokens": "5", "temperature": "0", "schema": json.dumps(SCHEMA),
    }  # fmt: skip
    values.update(fields)
    return values


async def test_a_schema_constrains_both_sides(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    async with web.http() as http:
        csrf = await _signed_in(http, registry_models)
        web.fake.submitted.clear()
        page = await http.post("/admin/playground", data=_form(csrf))
        assert page.status_code == 200, page.text[:500]
        assert "field-error" not in page.text
        assert json.dumps(SCHEMA).replace('"', "&#34;") in page.text  # kept in the box
        wanted = StructuredOutputsParams(json=SCHEMA)
        assert [s.params.structured_outputs for s in web.fake.submitted] == [wanted, wanted]
        assert {s.lora_key is None for s in web.fake.submitted} == {True, False}

        web.fake.submitted.clear()
        r = await http.post("/admin/playground/stream", data={**_form(csrf), "side": "adapter"})
        assert r.status_code == 200, r.text
        [run] = web.fake.submitted
        assert run.params.structured_outputs == wanted and run.lora_key is not None

        web.fake.submitted.clear()  # a blank box: free text
        page = await http.post("/admin/playground", data=_form(csrf, schema="  \n"))
        assert page.status_code == 200
        assert [s.params.structured_outputs for s in web.fake.submitted] == [None, None]


BAD = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ("[" * 50_000, "nests too deep"),
    ('{"type": "object", "items": ' + "[" * 70 + "]" * 70 + "}", "levels deep"),
    (json.dumps({"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (
        json.dumps({"type": "object", "description": "x" * MAX_SCHEMA_CHARS}),
        f"at most {MAX_SCHEMA_CHARS:,}",
    ),
]


@pytest.mark.parametrize(("schema", "words"), BAD)
async def test_a_bad_schema_is_an_inline_error_and_nothing_runs(
    web: WebEnv, registry_models: rf.RegistryModels, schema: str, words: str
) -> None:
    async with web.http() as http:
        csrf = await _signed_in(http, registry_models)
        web.fake.submitted.clear()
        page = await http.post("/admin/playground", data=_form(csrf, schema=schema))
        assert page.status_code == 400, page.text[:500]
        assert words in field_errors(page.text)["f-schema-help"]
        assert "data-answers hidden" in page.text  # no answers
        r = await http.post(
            "/admin/playground/stream", data={**_form(csrf, schema=schema), "side": "base"}
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "schema" and words in error["message"], error
    assert web.fake.submitted == []
