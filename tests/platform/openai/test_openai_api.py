"""The OpenAI-compatible API on the fake engine: response shapes, streaming, sampling fields."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from tests.utils.app import sse_events
from tests.utils.fakes import FakeEngineClient

pytestmark = pytest.mark.anyio

BASE = "tiny-chat"  # the served name defaults to the model directory's name
CHAT = {"model": BASE, "messages": [{"role": "user", "content": "t30 t31"}]}


async def post(api: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return await api.post(path, json=body)


async def test_completion_shape_and_usage(api: httpx.AsyncClient, fake: FakeEngineClient) -> None:
    r = await post(
        api, "/v1/completions", {"model": BASE, "prompt": "t30 t31 t32", "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == BASE and isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "text": " t10 t11 t12", "logprobs": None, "finish_reason": "length"}
    ]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 3, 6)
    assert r.headers["x-request-id"] == body["id"]
    (sub,) = fake.submitted
    assert sub.prompt_token_ids == [30, 31, 32] and sub.params.max_tokens == 3
    assert sub.lora_key is None and fake.aborted == []


async def test_max_tokens_omitted_is_16_for_completions_and_the_context_for_chat(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    r = await post(api, "/v1/completions", {"model": BASE, "prompt": [30, 31]})
    assert r.status_code == 200, r.text
    assert fake.submitted[0].params.max_tokens == 16  # OpenAI's and vLLM's default
    assert r.json()["usage"]["completion_tokens"] == 16
    r = await post(api, "/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text
    assert fake.submitted[1].params.max_tokens is None
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == fake.max_model_len - usage["prompt_tokens"]


async def test_chat_completion_uses_the_chat_template(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    r = await post(api, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": " t10 t11"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    # "t3 t30 t31 t4 t5": the template's markers around the message, then the generation prompt
    assert fake.submitted[0].prompt_token_ids == [3, 30, 31, 4, 5]
    assert body["usage"]["prompt_tokens"] == 5


async def test_chat_eos_finishes_with_stop(api: httpx.AsyncClient, fake: FakeEngineClient) -> None:
    fake.eos_after = 3
    r = await post(api, "/v1/chat/completions", CHAT)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == " t10 t11"  # the EOS token is not text
    assert r.json()["usage"]["completion_tokens"] == 3


async def test_n_samples_and_batched_prompts(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    r = await post(
        api,
        "/v1/completions",
        {"model": BASE, "prompt": ["t30", "t31 t32"], "n": 2, "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [" t10 t11", " t110 t111"] * 2
    assert r.json()["usage"]["prompt_tokens"] == 3
    assert r.json()["usage"]["completion_tokens"] == 8
    assert len(fake.submitted) == 2 and all(s.params.n == 2 for s in fake.submitted)


async def test_sampling_fields_reach_the_engine(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    r = await post(
        api,
        "/v1/chat/completions",
        {
            **CHAT,
            "max_tokens": 4,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 7,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "stop": ["xx", "yy"],
            "user": "end-user-1",
            "top_k": 5,
            "an_unknown_field": {"is": "ignored"},
        },
    )
    assert r.status_code == 200, r.text
    p = fake.submitted[0].params
    assert (p.temperature, p.top_p, p.seed, p.top_k) == (0.5, 0.9, 7, 5)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert p.stop_strings == ("xx", "yy") and p.max_tokens == 4


async def test_stop_string_ends_the_choice_and_aborts(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    r = await post(api, "/v1/completions", {"model": BASE, "prompt": "t30", "stop": "t13"})
    choice = r.json()["choices"][0]
    assert choice["text"] == " t10 t11 t12 " and choice["finish_reason"] == "stop"
    assert fake.aborted == [fake.submitted[0].request_id]  # the engine did not know the stop


async def test_completion_logprobs(api: httpx.AsyncClient) -> None:
    r = await post(
        api, "/v1/completions", {"model": BASE, "prompt": "t30", "max_tokens": 2, "logprobs": 2}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["t10", "t11"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["top_logprobs"][0] == {"t10": -0.5, "t3": -1.5}
    assert lp["text_offset"] == [0, 4]  # " t10" then " t11"


async def test_chat_logprobs_and_top_logprobs(api: httpx.AsyncClient) -> None:
    body = {**CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 3}
    r = await post(api, "/v1/chat/completions", body)
    (entry,) = r.json()["choices"][0]["logprobs"]["content"]
    assert entry["token"] == "t10" and entry["logprob"] == -0.5
    assert entry["bytes"] == list(b"t10")
    # -inf is not JSON: sent as -9999.0, as vLLM does
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.5, -1.5, -9999.0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_text_equals_non_stream_text(api: httpx.AsyncClient, path: str) -> None:
    body: dict[str, Any] = dict(CHAT) if "chat" in path else {"model": BASE, "prompt": "t30"}
    body.update(max_tokens=12, seed=1234, n=2, temperature=0.8)
    full = (await post(api, path, body)).json()
    r = await post(api, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    texts = ["", ""]
    finish: list[str | None] = [None, None]
    for chunk in chunks:
        assert chunk["id"].startswith("chatcmpl-" if "chat" in path else "cmpl-")
        assert chunk["usage"] is None and chunk["model"] == BASE
        (choice,) = chunk["choices"]
        piece = choice["delta"].get("content", "") if "chat" in path else choice["text"]
        texts[choice["index"]] += piece
        finish[choice["index"]] = choice["finish_reason"] or finish[choice["index"]]
    if "chat" in path:
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        expected = [c["message"]["content"] for c in full["choices"]]
    else:
        assert chunks[0]["object"] == "text_completion"
        expected = [c["text"] for c in full["choices"]]
    assert texts == expected and texts[0] != texts[1]  # seed + index: distinct samples
    assert finish == ["length", "length"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]


async def test_stream_without_usage_has_no_usage_field(api: httpx.AsyncClient) -> None:
    r = await post(
        api, "/v1/completions", {"model": BASE, "prompt": "t30", "max_tokens": 2, "stream": True}
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])


async def test_engine_death_mid_stream_ends_with_an_error_event(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    fake.die_after = 2
    r = await post(api, "/v1/chat/completions", {**CHAT, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_unavailable"
    assert "died" in error["message"]
    assert [e["choices"][0]["delta"].get("content") for e in events[1:-2]] == [" t10", " t11"]


async def test_engine_death_without_stream_is_503(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    fake.die_after = 2
    r = await post(api, "/v1/chat/completions", CHAT)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "engine_unavailable"


async def test_models_lists_base_and_adapters(
    api: httpx.AsyncClient, fake: FakeEngineClient, tmp_path: Any
) -> None:
    adapter = tmp_path / "secret-dir" / "my-adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    r = await post(api, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapter)})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "sql" and r.json()["parent"] == BASE and "path" not in r.text
    models = (await api.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["parent"], m["object"]) for m in models["data"]] == [
        (BASE, None, "model"),
        ("sql", BASE, "model"),
    ]
    assert "secret-dir" not in str(models)
    one = await api.get("/v1/models/sql")
    assert one.status_code == 200 and one.json()["parent"] == BASE

    # the adapter is selected by the model field; the response echoes its name
    r = await post(api, "/v1/chat/completions", {**CHAT, "model": "sql", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "sql"
    assert fake.submitted[-1].lora_key == next(iter(fake.adapters))

    r = await post(api, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert r.status_code == 200 and r.json()["deleted"] is True
    r = await post(api, "/v1/chat/completions", {**CHAT, "model": "sql"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert fake.adapters == {}


async def test_health_and_version(api: httpx.AsyncClient, fake: FakeEngineClient) -> None:
    r = await api.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["engine"]["healthy"] is True and r.json()["engine"]["num_running"] == 0
    fake.alive = False
    r = await api.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unhealthy"
    r = await api.get("/version")
    assert r.status_code == 200 and isinstance(r.json()["version"], str)


async def test_one_log_line_per_request(
    api: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="loraplex.platform.requests")
    await post(api, "/v1/completions", {"model": BASE, "prompt": "t30", "max_tokens": 2})
    await post(
        api, "/v1/completions", {"model": BASE, "prompt": "t30", "max_tokens": 2, "stream": True}
    )
    await post(api, "/v1/completions", {"model": "nope", "prompt": "t30"})
    lines = [r for r in caplog.records if r.name == "loraplex.platform.requests"]
    assert len(lines) == 3
    import json

    ok, streamed, missing = (json.loads(r.getMessage()) for r in lines)
    assert ok["status"] == 200 and ok["request_id"].startswith("cmpl-")
    assert (ok["model"], ok["prompt_tokens"], ok["completion_tokens"]) == (BASE, 1, 2)
    assert ok["latency_ms"] >= 0 and ok["finish_reasons"] == ["length"]
    assert streamed["stream"] is True and streamed["completion_tokens"] == 2
    assert missing["status"] == 404 and missing["error_code"] == "model_not_found"
