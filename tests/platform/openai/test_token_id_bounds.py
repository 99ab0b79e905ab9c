"""Issue 31: every token id a caller sends is one of the model's. ``stop_token_ids`` outside the
vocabulary (``[1e9]`` was accepted) is a 400 naming the field and the vocabulary's size, and the
list is bounded, so the engine's per-token stop test stays short."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loraplex.platform.openai.params import MAX_STOP_TOKEN_IDS
from tests.utils.fakes import FakeEngineClient

pytestmark = pytest.mark.anyio

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {"model": "tiny-chat", "messages": [{"role": "user", "content": "t30"}], "max_tokens": 2},
    ),
    "completions": ("/v1/completions", {"model": "tiny-chat", "prompt": "t30", "max_tokens": 2}),
}


@pytest.mark.parametrize("endpoint", sorted(BODIES))
@pytest.mark.parametrize(
    ("ids", "words"),
    [
        ([1e9], "stop_token_ids[0] is 1000000000"),
        ([3, 512], "stop_token_ids[1] is 512"),
        ([-1], "stop_token_ids[0] is -1"),
        ([2**62], "stop_token_ids[0] is about 10^18"),
    ],
)
async def test_stop_token_ids_outside_the_vocabulary_are_refused(
    api: httpx.AsyncClient, fake: FakeEngineClient, endpoint: str, ids: list[Any], words: str
) -> None:
    path, body = BODIES[endpoint]
    r = await api.post(path, json={**body, "stop_token_ids": ids})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("stop_token_ids", "invalid_token_id"), error
    assert error["type"] == "invalid_request_error"
    assert words in error["message"] and "512 tokens, ids 0 to 511" in error["message"], error
    assert fake.submitted == []


async def test_stop_token_ids_in_the_vocabulary_reach_the_engine(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    for endpoint, (path, body) in BODIES.items():
        r = await api.post(path, json={**body, "stop_token_ids": [0, 511, 7.0]})
        assert r.status_code == 200, (endpoint, r.text)
        assert fake.submitted[-1].params.stop_ids == (0, 511, 7)


async def test_the_stop_token_id_list_is_bounded(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    path, body = BODIES["completions"]
    many = [i % 512 for i in range(MAX_STOP_TOKEN_IDS + 1)]
    r = await api.post(path, json={**body, "stop_token_ids": many})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "stop_token_ids", error
    assert f"at most {MAX_STOP_TOKEN_IDS} are allowed" in error["message"], error
    r = await api.post(path, json={**body, "stop_token_ids": many[:-1]})
    assert r.status_code == 200, r.text
