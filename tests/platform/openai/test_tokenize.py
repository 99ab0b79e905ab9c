"""``/tokenize`` and ``/detokenize`` in vLLM's shapes: a prompt or a conversation (tools
included) tokenized exactly as the completion endpoints tokenize it, a round trip back to the
text, the bounds, and the tenant scope of ``model``."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.platform.openai import tokenize as tok
from tests.utils import registry as rf
from tests.utils.fakes import FakeEngineClient
from tests.utils.registry import registry_env, upload
from tests.utils.scripted import ScriptedAPI, scripted_api, smollm2_dir
from tests.utils.tenancy import bearer

pytestmark = pytest.mark.anyio
registry_models = rf.registry_models

MODEL = "SmolLM2-135M-Instruct"
TEXT = "Héllo wörld — déjà vu 😀, tabs\tand\nnewlines"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture
async def api(smollm2: Any) -> AsyncIterator[ScriptedAPI]:
    async with scripted_api(smollm2, smollm2_dir()) as api:
        api.say("ok")
        yield api


async def test_a_prompt_tokenizes_as_the_tokenizer_does(api: ScriptedAPI, smollm2: Any) -> None:
    r = await api.http.post("/tokenize", json={"model": MODEL, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = smollm2(TEXT).input_ids
    assert body == {
        "count": len(expected),
        "max_model_len": api.engine.max_model_len,
        "tokens": expected,
        "token_strs": None,
    }
    r = await api.http.post(
        "/tokenize",
        json={"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True},
    )
    body = r.json()
    assert body["tokens"] == smollm2(TEXT, add_special_tokens=False).input_ids
    assert body["token_strs"] == smollm2.convert_ids_to_tokens(body["tokens"])


async def test_round_trip(api: ScriptedAPI) -> None:
    r = await api.http.post("/tokenize", json={"model": MODEL, "prompt": TEXT})
    tokens = r.json()["tokens"]
    r = await api.http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT}


@pytest.mark.parametrize("with_tools", [False, True])
async def test_messages_tokenize_as_the_chat_endpoint_renders_them(
    api: ScriptedAPI, with_tools: bool
) -> None:
    extra: dict[str, Any] = {"tools": TOOLS} if with_tools else {}
    r = await api.http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, **extra})
    assert r.status_code == 200, r.text
    chat = await api.http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **extra}
    )
    assert chat.status_code == 200, chat.text
    assert r.json()["tokens"] == api.submitted[-1].prompt_token_ids
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]


async def test_generation_prompt_and_continued_messages(api: ScriptedAPI, smollm2: Any) -> None:
    def text_of(body: dict[str, Any]) -> str:
        return str(smollm2.decode(body["tokens"]))

    base = {"model": MODEL, "messages": MESSAGES}
    opened = (await api.http.post("/tokenize", json=base)).json()
    closed = (
        await api.http.post("/tokenize", json={**base, "add_generation_prompt": False})
    ).json()
    assert text_of(opened).endswith("<|im_start|>assistant\n")
    assert text_of(closed).endswith("<|im_end|>\n")
    partial = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    r = await api.http.post(
        "/tokenize", json={"model": MODEL, "messages": partial, "continue_final_message": True}
    )
    assert text_of(r.json()).endswith("<|im_start|>assistant\nIt is")


async def test_the_work_runs_off_the_event_loop(
    api: ScriptedAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    real = tok.render_chat_text

    def spy(*args: Any, **kwargs: Any) -> str:
        seen.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(tok, "render_chat_text", spy)
    r = await api.http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200 and seen == [False]


BAD = [
    ("/tokenize", {"model": MODEL}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "messages", "invalid_value"),
    ("/tokenize", {"prompt": "a" * (tok.MAX_TOKENIZE_CHARS + 1)}, "prompt", "prompt_too_long"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, "model", "model_not_found"),
    (
        "/tokenize",
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools[0].function.name",
        "invalid_tool_name",
    ),
    (
        "/tokenize",
        {"messages": MESSAGES, "chat_template": "{{ messages }}"},
        "chat_template",
        "unsupported_parameter",
    ),
    ("/detokenize", {"tokens": [1, 49152]}, "tokens[1]", "invalid_token_id"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]", "invalid_token_id"),
    ("/detokenize", {"tokens": [0] * (tok.MAX_DETOKENIZE_TOKENS + 1)}, "tokens", "too_many_tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens", None),
    ("/detokenize", {"model": "nope", "tokens": [1]}, "model", "model_not_found"),
]


@pytest.mark.parametrize(("path", "body", "param", "code"), BAD)
async def test_bounds_and_bad_input(
    api: ScriptedAPI, path: str, body: dict[str, Any], param: str, code: str | None
) -> None:
    r = await api.http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


async def test_model_resolves_within_the_callers_tenant(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any, fake: FakeEngineClient
) -> None:
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        acme, beta = env.tenant("acme"), env.tenant("beta")
        r = await upload(env.http, acme, "bot", registry_models.adapters["a"].files())
        assert r.status_code == 201, r.text
        body = {"model": "bot", "prompt": "t30 t31"}
        r = await env.http.post("/tokenize", json=body, headers=bearer(acme))
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [30, 31]  # the adapter uses the base model's tokenizer
        for path, payload in (
            ("/tokenize", body),
            ("/detokenize", {"model": "bot", "tokens": [5]}),
        ):
            other = await env.http.post(path, json=payload, headers=bearer(beta))
            assert other.status_code == 404, other.text  # another tenant's adapter: as if none
            assert other.json()["error"]["code"] == "model_not_found"
            nobody = await env.http.post(path, json=payload)
            assert nobody.status_code == 401
        r = await env.http.post(
            "/detokenize", json={"model": "bot@1", "tokens": [30, 31]}, headers=bearer(acme)
        )
        assert r.status_code == 200 and r.json() == {"prompt": "t30 t31"}
