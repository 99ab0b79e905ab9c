"""A client that goes away: its engine request is aborted at once, streamed or not."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from tests.utils.app import make_app
from tests.utils.asgi import drive_until_disconnect
from tests.utils.fakes import FakeEngineClient

pytestmark = pytest.mark.anyio


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

    sent = await drive_until_disconnect(app, path, body, got_tokens)
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
    await drive_until_disconnect(app, "/v1/completions", body, lambda _: bool(fake.submitted))
    assert fake.aborted == [fake.submitted[0].request_id] and fake.finished == []


async def test_batched_prompts_are_all_aborted(fake: FakeEngineClient, tokenizer: Any) -> None:
    fake.step_delay = 0.02
    app = make_app(fake, tokenizer)
    body = {"model": "tiny-chat", "prompt": ["t30", "t31", "t32"], "stream": True}
    await drive_until_disconnect(app, "/v1/completions", body, lambda _: len(fake.submitted) == 3)
    assert sorted(fake.aborted) == sorted(s.request_id for s in fake.submitted)
