"""A client that goes away: its engine request is aborted at once, streamed or not."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from tests.platform.conftest import make_app
from tests.platform.fakes import FakeEngineClient

pytestmark = pytest.mark.anyio


def _scope(path: str, extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test"), *extra_headers],
        "client": ("127.0.0.1", 5000),
        "server": ("test", 80),
    }


async def _drive_until_disconnect(
    app: Any,
    path: str,
    body: dict[str, Any],
    leave_when: Any,
    extra_headers: tuple[tuple[bytes, bytes], ...] = (),
) -> list[dict[str, Any]]:
    """Runs one request through ``app``; the client disconnects once ``leave_when()``."""
    inbox = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set():
            raise OSError("the client is gone")
        sent.append(message)

    task = asyncio.ensure_future(app(_scope(path, extra_headers), receive, send))
    for _ in range(2000):
        if leave_when(sent):
            break
        await asyncio.sleep(0.005)
    gone.set()
    await asyncio.wait_for(task, timeout=10)
    return sent


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_streaming_client_leaving_aborts_the_request(
    fake: FakeEngineClient, tokenizer: Any, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="loraplex.platform.requests")
    fake.step_delay = 0.02  # 64 tokens would take over a second
    app = make_app(fake, tokenizer)
    body: dict[str, Any] = {"model": "tiny-chat", "stream": True}
    body.update(
        {"prompt": "t30"}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "t30"}]}
    )

    def got_tokens(sent: list[dict[str, Any]]) -> bool:
        return sum(1 for m in sent if m.get("body")) >= 3

    sent = await _drive_until_disconnect(app, path, body, got_tokens)
    assert sent[0]["status"] == 200
    assert fake.aborted == [fake.submitted[0].request_id] and fake.finished == []
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name.endswith("requests")]
    assert line["status"] == 499 and 0 < line["completion_tokens"] < 64


async def test_non_streaming_client_leaving_aborts_the_request(
    fake: FakeEngineClient, tokenizer: Any
) -> None:
    fake.step_delay = 0.02
    app = make_app(fake, tokenizer)
    body = {"model": "tiny-chat", "prompt": "t30"}
    await _drive_until_disconnect(app, "/v1/completions", body, lambda _: bool(fake.submitted))
    assert fake.aborted == [fake.submitted[0].request_id] and fake.finished == []


async def test_batched_prompts_are_all_aborted(fake: FakeEngineClient, tokenizer: Any) -> None:
    fake.step_delay = 0.02
    app = make_app(fake, tokenizer)
    body = {"model": "tiny-chat", "prompt": ["t30", "t31", "t32"], "stream": True}
    await _drive_until_disconnect(app, "/v1/completions", body, lambda _: len(fake.submitted) == 3)
    assert sorted(fake.aborted) == sorted(s.request_id for s in fake.submitted)
