"""Every 4xx the OpenAI routes answer carries a machine-readable ``code`` (never null), and the
404 for an unknown path says the path is unknown and lists the real endpoints."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.utils import errors, malformed

pytestmark = pytest.mark.anyio

BASE = "tiny-chat"
CHAT: dict[str, Any] = {"model": BASE, "messages": [{"role": "user", "content": "t30"}]}
COMPLETION: dict[str, Any] = {"model": BASE, "prompt": "t30"}

# Every bad body the other error tests send, and a few more of params.py's and serving.py's.
BODIES: list[tuple[str, dict[str, Any]]] = [
    *((path, body) for path, body, _, _ in errors.BAD_BODIES),
    *((path, body) for path, body, _, _ in malformed.BAD_BODIES),
    ("/v1/chat/completions", {**CHAT, "n": 17}),
    ("/v1/chat/completions", {**CHAT, "stop": ["x"] * 17}),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}),
    ("/v1/chat/completions", {**CHAT, "temperature": 0.5, "top_k": -2}),
    ("/v1/completions", {**COMPLETION, "prompt": []}),
    ("/v1/completions", {**COMPLETION, "prompt": ["t30"] * 65}),
    ("/v1/completions", {**COMPLETION, "prompt": ["t30", ""]}),
    ("/v1/completions", {**COMPLETION, "model": "no-such-model"}),
    ("/v1/completions", {**COMPLETION, "guided_regex": "a+"}),
]


@pytest.mark.parametrize(("path", "body"), BODIES)
async def test_every_bad_body_has_a_code(
    api: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    r = await api.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert isinstance(error["code"], str) and error["code"], error


async def test_n_over_the_limit_is_invalid_value(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/chat/completions", json={**CHAT, "n": 17})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_value")


async def test_other_4xx_have_codes(api: httpx.AsyncClient, keyed_api: httpx.AsyncClient) -> None:
    responses = [
        await api.get("/v1/nope"),
        await api.get("/v1/completions"),
        await api.post("/v1/completions", content=b"{", headers={"content-type": "x"}),
        await api.post("/v1/completions", content=b"x" * 70_000),
        await api.get("/v1/models/no-such-model"),
        await keyed_api.get("/v1/models"),
        await keyed_api.post("/v1/chat/completions", json=CHAT),
    ]
    for r in responses:
        assert 400 <= r.status_code < 500, r.text
        assert r.json()["error"]["code"], r.text


@pytest.mark.parametrize("path", ["/v1/nope", "/v1/chat/completion", "/v2/completions", "/x"])
async def test_unknown_path_says_so_and_lists_the_endpoints(
    api: httpx.AsyncClient, path: str
) -> None:
    r = await api.get(path)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["code"], error["type"]) == ("not_found", "not_found_error")
    message = error["message"]
    assert f"There is no endpoint GET {path}" in message, message
    for endpoint in (
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
        "GET /v1/models/{name}",
    ):
        assert endpoint in message, message
    assert "lives under /v1" not in message


async def test_a_huge_unknown_path_is_not_echoed_whole(api: httpx.AsyncClient) -> None:
    r = await api.get("/v1/" + "x" * 5000)
    assert r.status_code == 404
    assert len(r.json()["error"]["message"]) < 1000
