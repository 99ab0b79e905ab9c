"""Every bad request gets a 4xx in OpenAI's envelope that names the field and says what to do;
never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.utils.app import API_KEY
from tests.utils.errors import BAD_BODIES, BASE, CHAT, COMPLETION, assert_error
from tests.utils.fakes import FakeEngineClient

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD_BODIES)
async def test_bad_request_is_400_naming_the_field(
    api: httpx.AsyncClient, path: str, body: dict[str, Any], param: str | None, words: str
) -> None:
    import json

    # ensure_ascii keeps lone surrogates as \\udxxx escapes, as a client would send them
    r = await api.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    error = assert_error(r, 400, param)
    assert error["type"] == "invalid_request_error"
    assert words in error["message"], error["message"]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b'{"model": "tiny-chat", "prompt": ', "not valid JSON"),
        (b'{"model": "tiny-chat", "prompt": "\xff\xfe"}', "UTF-8"),
        (b"\xff\xfe\x00{", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b"", "no body"),
        (b'{"model": "tiny-chat", "prompt": "t30", "temperature": NaN}', "finite"),
    ],
)
async def test_undecodable_bodies_are_400(
    api: httpx.AsyncClient, content: bytes, words: str
) -> None:
    r = await api.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    error = assert_error(r, 400, "temperature" if b"NaN" in content else None)
    assert words in error["message"], error["message"]


async def test_unknown_model_is_404(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"})
    error = assert_error(r, 404, "model", "model_not_found")
    assert "'gpt-4'" in error["message"] and "/v1/models" in error["message"]
    assert_error(await api.get("/v1/models/gpt-4"), 404, "model", "model_not_found")


async def test_body_over_the_limit_is_413(api: httpx.AsyncClient) -> None:
    big = {**COMPLETION, "prompt": "t30 " * 20_000}  # the fixture allows 64 KiB
    r = await api.post("/v1/completions", json=big)
    error = assert_error(r, 413, None, "request_too_large")
    assert "65536 bytes" in error["message"]

    async def chunked() -> Any:  # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b" " * 4096

    r = await api.post(
        "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
    )
    assert_error(r, 413, None, "request_too_large")


async def test_unknown_route_and_method(api: httpx.AsyncClient) -> None:
    assert_error(await api.get("/v1/nope"), 404, None, "not_found")
    assert_error(await api.get("/v1/completions"), 405, None, "method_not_allowed")


async def test_unhealthy_engine_is_503(api: httpx.AsyncClient, fake: FakeEngineClient) -> None:
    fake.alive = False
    r = await api.post("/v1/chat/completions", json=CHAT)
    error = assert_error(r, 503, None, "engine_unavailable")
    assert error["type"] == "server_error" and "retry" in error["message"]
    assert r.headers["retry-after"] == "5"


async def test_bad_adapter_is_400_with_its_code(api: httpx.AsyncClient, tmp_path: Any) -> None:
    r = await api.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert_error(r, 400, "lora_path", "missing_file")
    r = await api.post("/v1/load_lora_adapter", json={"lora_name": "bad name!", "lora_path": "/x"})
    assert_error(r, 400, "lora_name")
    r = await api.post("/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": "/x"})
    assert_error(r, 400, "lora_name", "adapter_name_taken")
    r = await api.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert_error(r, 404, "lora_name", "adapter_not_found")


# ---- auth ------------------------------------------------------------------------------------


async def test_missing_key_is_401_saying_how_to_send_it(keyed_api: httpx.AsyncClient) -> None:
    r = await keyed_api.post("/v1/chat/completions", json=CHAT)
    error = assert_error(r, 401, None, "missing_api_key")
    assert "Authorization: Bearer" in error["message"]
    assert r.headers["www-authenticate"] == "Bearer"
    assert_error(await keyed_api.get("/v1/models"), 401, None, "missing_api_key")


@pytest.mark.parametrize(
    ("header", "code"),
    [
        ("Bearer sk-wrong-key-000000000000", "invalid_api_key"),
        (f"Basic {API_KEY}", "invalid_authorization_header"),
        ("Bearer", "invalid_authorization_header"),
    ],
)
async def test_bad_key_is_401(keyed_api: httpx.AsyncClient, header: str, code: str) -> None:
    r = await keyed_api.post("/v1/chat/completions", json=CHAT, headers={"Authorization": header})
    error = assert_error(r, 401, None, code)
    assert API_KEY not in error["message"]


async def test_right_key_passes_and_guards_adapter_admin(keyed_api: httpx.AsyncClient) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = await keyed_api.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}, headers=auth)
    assert r.status_code == 200, r.text
    r = await keyed_api.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert_error(r, 401, None, "missing_api_key")
    # health and version need no key (load balancers, probes)
    assert (await keyed_api.get("/health")).status_code == 200
    assert (await keyed_api.get("/version")).status_code == 200
