"""The engine process dies (kill -9) under HTTP load: every in-flight request ends at once with
an error in OpenAI's shape (503 for a JSON response, a last ``data: {"error": ...}`` event for a
stream); ``/health`` answers 503 while the engine is down and 200 once it is back; then requests,
adapters included, succeed again with the same outputs as before the crash."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from loraplex.engine.proc_client import ProcEngineClient
from loraplex.platform.settings import load_settings
from loraplex.server import create_app
from tests.utils.app import add_chat_template
from tests.utils.models import make_adapter, make_tiny_model
from tests.utils.server import ServerThread

LONG = 900  # tokens: seconds of decoding, so every request is mid-flight at the kill
ERROR_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Any]]:
    root = tmp_path_factory.mktemp("crash")
    model_dir = make_tiny_model(root / "tiny", "llama", seed=9, max_position_embeddings=1024)
    add_chat_template(model_dir)
    adapter_dir = make_adapter(model_dir, root / "sql", 4, 8, ["q_proj", "v_proj"], seed=2)
    config = EngineConfig(
        model=ModelConfig(model=model_dir, max_model_len=1024),
        cache=CacheConfig(block_size=16, num_blocks=512),
        lora=LoRAConfig(max_loras=2, max_lora_rank=8),
    )
    client = ProcEngineClient(config, model_dir, num_threads=1)
    app = create_app(client, load_settings(served_model_name="tiny"), own_client=True)

    @app.get("/test/engine-stats", include_in_schema=False)
    async def engine_stats() -> dict[str, Any]:
        return dataclasses.asdict(await client.stats())

    with ServerThread(app) as server:
        r = httpx.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": "sql", "lora_path": adapter_dir},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        yield server, client


def _body(model: str, chat: bool, max_tokens: int, stream: bool) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": "t40 t41 t42 t43"}]
        return "/v1/chat/completions", body
    body["prompt"] = "t40 t41 t42 t43"
    return "/v1/completions", body


def _text(r: httpx.Response, chat: bool) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return str(choice["message"]["content"] if chat else choice["text"])


# (model, chat, stream) of the requests in flight at the kill: both endpoints, both models
IN_FLIGHT = [
    (model, chat, stream)
    for model in ("tiny", "sql")
    for chat in (False, True)
    for stream in (False, True)
]


def test_kill_9_fails_inflight_requests_then_serves_again(
    served: tuple[ServerThread, ProcEngineClient],
) -> None:
    server, client = served
    url = server.url
    before = {
        (model, chat): _text(httpx.post(url + path, json=body, timeout=60), chat)
        for model in ("tiny", "sql")
        for chat in (False, True)
        for path, body in [_body(model, chat, 12, False)]
    }

    async def kill_under_load() -> tuple[list[tuple[Any, float]], list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            streaming_started = 0
            killed_at = 0.0

            async def one(model: str, chat: bool, stream: bool) -> tuple[Any, float]:
                nonlocal streaming_started
                path, body = _body(model, chat, LONG, stream)
                if not stream:
                    r = await http.post(path, json=body)
                    return r, time.monotonic() - killed_at
                events: list[Any] = []
                async with http.stream("POST", path, json=body) as r:
                    assert r.status_code == 200
                    counted = False
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line.removeprefix("data: ")
                        events.append(data if data == "[DONE]" else json.loads(data))
                        if not counted:
                            counted = True
                            streaming_started += 1
                return events, time.monotonic() - killed_at

            tasks = [asyncio.create_task(one(*spec)) for spec in IN_FLIGHT]
            # Every request is running in the engine (and every stream has sent its first
            # chunk) before the engine is killed.
            streams = sum(1 for *_, stream in IN_FLIGHT if stream)
            deadline = time.monotonic() + 30
            while True:
                stats = (await http.get("/test/engine-stats")).json()
                if stats["num_running"] == len(IN_FLIGHT) and streaming_started == streams:
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.02)
            assert not any(t.done() for t in tasks)
            pid = client.pid
            assert pid is not None
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            # /health says so while the engine is down; new requests are refused with 503.
            down: list[httpx.Response] = []
            while time.monotonic() - killed_at < ERROR_WITHIN_S and len(down) < 2:
                health = await http.get("/health")
                if health.status_code == 503:
                    down.append(health)
                    path, body = _body("sql", True, 4, False)
                    down.append(await http.post(path, json=body))
                await asyncio.sleep(0.01)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 2 * ERROR_WITHIN_S)
            return results, down, killed_at

    results, down, killed_at = asyncio.run(kill_under_load())

    delays = []
    for (model, chat, stream), (result, delay) in zip(IN_FLIGHT, results, strict=True):
        delays.append(delay)
        assert delay < ERROR_WITHIN_S, (model, chat, stream, delay)
        if stream:
            events = result
            assert events[-1] == "[DONE]", events[-3:]
            error = events[-2]["error"]
            assert not any("error" in e for e in events[:-2] if isinstance(e, dict))
        else:
            assert result.status_code == 503, result.text
            assert result.headers["retry-after"]
            error = result.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("server_error", "engine_unavailable"), error
        assert "died" in error["message"] and "retry" in error["message"], error

    assert len(down) == 2, "/health did not answer 503 within 5 s of the kill"
    health, refused = down
    assert health.status_code == 503
    assert health.json()["status"] == "unhealthy" and health.json()["engine"]["healthy"] is False
    assert "died" in health.json()["engine"]["reason"], health.json()
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "engine_unavailable"

    # The engine comes back on its own, with the adapter, and answers as before.
    while (health := httpx.get(f"{url}/health", timeout=10)).status_code != 200:
        assert time.monotonic() - killed_at < 120, health.text
        time.sleep(0.1)
    restart_s = time.monotonic() - killed_at
    assert health.json()["status"] == "ok" and health.json()["engine"]["engine_restarts"] == 1
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "sql"]
    for (model, chat), text in before.items():
        path, body = _body(model, chat, 12, False)
        assert _text(httpx.post(url + path, json=body, timeout=60), chat) == text, (model, chat)
    stats = httpx.get(f"{url}/test/engine-stats").json()
    assert stats["num_inflight"] == stats["num_running"] == stats["kv_blocks_used"] == 0
    print(
        f"\nENGINE-CRASH: kill -9 -> error on all {len(delays)} in-flight requests in "
        f"{min(delays) * 1000:.0f}..{max(delays) * 1000:.0f} ms; /health 200 again "
        f"{restart_s:.1f} s after the kill"
    )
