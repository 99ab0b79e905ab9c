"""max_tokens when a request sets none: 16 on /v1/completions (OpenAI's and vLLM's default), the
operator's ``default_max_tokens`` (else up to the context) on /v1/chat/completions; a default is
cut to the room the prompt leaves, so it never makes a request fail."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from loraplex.platform.settings import load_settings
from loraplex.server.serve import add_serve_arguments
from tests.utils.app import make_app
from tests.utils.fakes import FakeEngineClient

pytestmark = pytest.mark.anyio

BASE = "tiny-chat"
CHAT: dict[str, Any] = {"model": BASE, "messages": [{"role": "user", "content": "t30"}]}


@pytest.fixture
async def capped_api(fake: FakeEngineClient, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(fake, tokenizer, default_max_tokens=5)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


async def test_completions_default_to_16_tokens(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    r = await api.post("/v1/completions", json={"model": BASE, "prompt": "t30 t31"})
    assert r.status_code == 200, r.text
    assert fake.submitted[0].params.max_tokens == 16
    assert r.json()["usage"]["completion_tokens"] == 16
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_completions_default_is_cut_to_the_room_left(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    # 60 prompt tokens on a 64-token context: 4 tokens, not a context-length error
    r = await api.post("/v1/completions", json={"model": BASE, "prompt": list(range(3, 63))})
    assert r.status_code == 200, r.text
    assert fake.submitted[0].params.max_tokens == 4
    # a batch: cut to what its longest prompt leaves
    prompts = ["t30", " ".join(["t31"] * 55)]
    r = await api.post("/v1/completions", json={"model": BASE, "prompt": prompts})
    assert r.status_code == 200, r.text
    assert {s.params.max_tokens for s in fake.submitted[1:]} == {9}


async def test_an_explicit_max_tokens_still_wins_and_is_checked(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    r = await api.post("/v1/completions", json={"model": BASE, "prompt": "t30", "max_tokens": 40})
    assert r.status_code == 200 and fake.submitted[0].params.max_tokens == 40
    r = await api.post("/v1/completions", json={"model": BASE, "prompt": "t30", "max_tokens": 64})
    assert r.json()["error"]["code"] == "context_length_exceeded"


async def test_chat_runs_to_the_context_without_a_server_default(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    r = await api.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    assert fake.submitted[0].params.max_tokens is None


async def test_chat_uses_the_server_default_max_tokens(
    capped_api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    r = await capped_api.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    assert fake.submitted[0].params.max_tokens == 5
    assert r.json()["usage"]["completion_tokens"] == 5
    # either field given wins over the default
    for field in ("max_tokens", "max_completion_tokens"):
        r = await capped_api.post("/v1/chat/completions", json={**CHAT, field: 9})
        assert r.status_code == 200, r.text
        assert fake.submitted[-1].params.max_tokens == 9, field
    # cut to the room: "t3 <60 tokens> t4 t5" leaves 1 of the 64
    long = {**CHAT, "messages": [{"role": "user", "content": " ".join(["t30"] * 60)}]}
    r = await capped_api.post("/v1/chat/completions", json=long)
    assert r.status_code == 200, r.text
    assert fake.submitted[-1].params.max_tokens == 1


async def test_completions_ignore_the_chat_default(
    capped_api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    r = await capped_api.post("/v1/completions", json={"model": BASE, "prompt": "t30"})
    assert r.status_code == 200 and fake.submitted[0].params.max_tokens == 16


def test_default_max_tokens_setting_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().default_max_tokens is None
    assert load_settings(default_max_tokens=128).default_max_tokens == 128
    monkeypatch.setenv("LORAPLEX_DEFAULT_MAX_TOKENS", "256")
    assert load_settings().default_max_tokens == 256
    for bad in (0, -1, 10**9):
        with pytest.raises(ValidationError, match="default_max_tokens"):
            load_settings(default_max_tokens=bad)


def test_serve_flags_for_max_tokens_and_request_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_serve_arguments(parser)
        return parser.parse_args(list(argv))

    args = parse()
    assert (args.default_max_tokens, args.max_request_bytes) == (None, None)
    args = parse("--default-max-tokens", "64", "--max-request-bytes", "2048")
    assert (args.default_max_tokens, args.max_request_bytes) == (64, 2048)
    monkeypatch.setenv("LORAPLEX_DEFAULT_MAX_TOKENS", "32")
    monkeypatch.setenv("LORAPLEX_MAX_REQUEST_BYTES", "4096")
    args = parse()
    assert (args.default_max_tokens, args.max_request_bytes) == (32, 4096)
