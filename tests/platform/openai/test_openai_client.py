"""The official ``openai`` client, unchanged, against the API: async over ASGI, sync over a real
uvicorn server; on the fake engine and on the real in-process engine with a tiny model."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loraplex.platform.settings import ServerSettings
from loraplex.server import create_app
from tests.utils.app import API_KEY, add_chat_template, make_app
from tests.utils.fakes import FakeEngineClient
from tests.utils.models import make_tiny_model
from tests.utils.server import ServerThread

MESSAGES: list[Any] = [{"role": "user", "content": "t30 t31"}]


@pytest.mark.anyio
async def test_async_client_over_asgi(fake: FakeEngineClient, tokenizer: Any) -> None:
    app = make_app(fake, tokenizer, api_key=API_KEY)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    client = openai.AsyncOpenAI(api_key=API_KEY, base_url="http://test/v1", http_client=http)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]
    chat = await client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=3, seed=5, n=2
    )
    assert chat.object == "chat.completion" and len(chat.choices) == 2
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert chat.usage.completion_tokens == 6
    stream = await client.chat.completions.create(
        model="tiny-chat",
        messages=MESSAGES,
        max_tokens=3,
        seed=5,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", ""]
    usage = None
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in chat.choices]
    assert usage is not None and usage.total_tokens == chat.usage.total_tokens

    with pytest.raises(openai.NotFoundError) as missing:
        await client.completions.create(model="nope", prompt="t30")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model="tiny-chat", prompt="t30", max_tokens=100)
    assert bad.value.param == "max_tokens"
    wrong = openai.AsyncOpenAI(api_key="sk-wrong", base_url="http://test/v1", http_client=http)
    with pytest.raises(openai.AuthenticationError):
        await wrong.models.list()
    await http.aclose()


def test_sync_client_over_uvicorn(fake: FakeEngineClient, tokenizer: Any) -> None:
    app = create_app(fake, ServerSettings(api_key=API_KEY), tokenizer=tokenizer, own_client=True)
    with ServerThread(app) as server:
        assert fake.started  # own_client: the lifespan started it
        client = openai.OpenAI(api_key=API_KEY, base_url=f"{server.url}/v1", max_retries=0)
        done = client.completions.create(model="tiny-chat", prompt="t30", max_tokens=4, seed=3)
        assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="tiny-chat", prompt="t30", max_tokens=4, seed=3, stream=True
            )
            if c.choices
        )
        assert streamed == done.choices[0].text
    assert not fake.started  # and the lifespan shut it down


# ---- the real in-process engine --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = make_tiny_model(tmp_path_factory.mktemp("engine") / "tiny-llama-chat", "llama", seed=3)
    add_chat_template(path)
    return path


@pytest.fixture(scope="module")
def engine_server(tiny_chat_model: str) -> Iterator[ServerThread]:
    from loraplex.config import CacheConfig, EngineConfig, ModelConfig
    from loraplex.engine.inproc_client import InprocEngineClient

    config = EngineConfig(
        model=ModelConfig(model=tiny_chat_model, max_model_len=256),
        cache=CacheConfig(block_size=16, num_blocks=64),
    )
    client = InprocEngineClient(config, tiny_chat_model)
    app = create_app(client, ServerSettings(served_model_name="tiny"), own_client=True)
    with ServerThread(app) as server:
        yield server


def _kv_blocks_used(server: ServerThread) -> int:
    engine = httpx.get(f"{server.url}/health").json()["engine"]
    return int(engine["kv_blocks_used"])


def test_real_engine_chat_and_completions(engine_server: ServerThread) -> None:
    client = openai.OpenAI(api_key="unused", base_url=f"{engine_server.url}/v1", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    greedy = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0
    )
    again = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert greedy.choices[0].message.content == again.choices[0].message.content
    assert greedy.usage is not None and greedy.usage.prompt_tokens == 5
    kwargs: dict[str, Any] = dict(model="tiny", prompt="t30 t31 t32", max_tokens=10, seed=11, n=2)
    full = client.completions.create(**kwargs)
    texts = ["", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in full.choices]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt="t30 " * 250, max_tokens=10)
    assert too_long.value.param == "max_tokens" and "256" in str(too_long.value)
    assert _kv_blocks_used(engine_server) == 0


def test_real_engine_disconnect_frees_kv_blocks(engine_server: ServerThread) -> None:
    body = {"model": "tiny", "prompt": "t30 t31", "max_tokens": 200, "stream": True}
    # leaving the block closes the connection mid-stream
    with (
        httpx.Client(base_url=engine_server.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert _kv_blocks_used(engine_server) > 0  # still generating
    deadline = time.monotonic() + 10
    while _kv_blocks_used(engine_server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kv_blocks_used(engine_server) == 0
    engine = httpx.get(f"{engine_server.url}/health").json()["engine"]
    assert engine["num_running"] == 0 and engine["num_inflight"] == 0


def test_real_engine_adapter_errors(engine_server: ServerThread, tmp_path: Path) -> None:
    r = httpx.post(
        f"{engine_server.url}/v1/load_lora_adapter",
        json={"lora_name": "a1", "lora_path": str(tmp_path)},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_path" and error["code"] and str(tmp_path) not in error["code"]


def test_real_engine_serves_an_adapter_by_model_name(
    engine_server: ServerThread, tmp_path: Path
) -> None:
    from tests.utils.adapters import make_peft

    make_peft(tmp_path / "sql-adapter", r=8, target_modules=["q_proj", "v_proj"])
    url = engine_server.url
    r = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "sql", "lora_path": str(tmp_path / "sql-adapter")},
    )
    assert r.status_code == 200, r.text
    assert (r.json()["rank"], r.json()["parent"]) == (8, "tiny")
    client = openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0)
    assert [(m.id, getattr(m, "parent", None)) for m in client.models.list().data] == [
        ("tiny", None),
        ("sql", "tiny"),
    ]
    kwargs: dict[str, Any] = dict(prompt="t30 t31 t32", max_tokens=12, temperature=0)
    base = client.completions.create(model="tiny", **kwargs)
    tuned = client.completions.create(model="sql", **kwargs)
    assert tuned.model == "sql" and tuned.choices[0].text != base.choices[0].text
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql", **kwargs)
