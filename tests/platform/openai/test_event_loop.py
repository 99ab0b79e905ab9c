"""A large prompt does not stall other clients: while a 7 MB prompt is refused, or a long valid
one is tokenized, ``/version`` keeps answering (real uvicorn, real SmolLM2 tokenizer, fake
engine). Before tokenizing moved off the event loop, ``/version`` waited seconds."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.utils.app import make_app
from tests.utils.fakes import FakeEngineClient
from tests.utils.server import ServerThread

# Generous: the old code answered /version after seconds (the whole tokenization); the new one
# takes milliseconds. Two shared CPU cores may add some hundreds of milliseconds.
MAX_LATENCY_S = 1.0


@pytest.fixture
def serve(smollm2: Any) -> Iterator[Any]:
    servers: list[ServerThread] = []

    def start(max_model_len: int) -> str:
        fake = FakeEngineClient(
            model_dir=smollm2.name_or_path, max_model_len=max_model_len, vocab_size=49152
        )
        # a KV cache that holds a whole context
        fake.info = dataclasses.replace(fake.info, num_blocks=max_model_len // 16)
        app = make_app(fake, smollm2, served_model_name="smol", max_request_bytes=16 * 1024 * 1024)
        server = ServerThread(app).__enter__()
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def _latencies_during(url: str, path: str, body: dict[str, Any]) -> tuple[list[float], Any]:
    """``/version`` latencies, one poll every 20 ms, while ``body`` is posted to ``path``."""
    content = json.dumps(body).encode()
    result: dict[str, Any] = {}

    def big() -> None:
        headers = {"content-type": "application/json"}
        result["response"] = httpx.post(url + path, content=content, headers=headers, timeout=300)

    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=300) as client:
        assert client.get("/version").status_code == 200  # connection warm
        thread = threading.Thread(target=big)
        thread.start()
        while thread.is_alive():
            start = time.perf_counter()
            assert client.get("/version").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
        thread.join()
    return latencies, result["response"]


HUGE = "hello world, this is a long prompt. " * 200_000  # 7.2 MB


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "smol", "prompt": HUGE}),
        (
            "/v1/chat/completions",
            {"model": "smol", "messages": [{"role": "user", "content": HUGE}]},
        ),
    ],
    ids=["completions", "chat"],
)
def test_version_answers_while_a_7mb_prompt_is_refused(
    serve: Any, path: str, body: dict[str, Any]
) -> None:
    url = serve(8192)
    latencies, response = _latencies_during(url, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert latencies and max(latencies) < MAX_LATENCY_S, max(latencies)


def test_version_answers_while_a_long_valid_prompt_is_tokenized(serve: Any) -> None:
    # 4,000,000 characters of 64-character tokens: 62,500 tokens, which a 65,536-token context
    # holds, so every character is tokenized (seconds of CPU).
    url = serve(65536)
    body = {"model": "smol", "prompt": "#" * 4_000_000, "max_tokens": 1}
    latencies, response = _latencies_during(url, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 62_500
    assert latencies and max(latencies) < MAX_LATENCY_S, max(latencies)
