"""`loraplex serve --default-max-tokens N --max-request-bytes B` reach the server: a chat request
without max_tokens stops after N tokens, a completion after 16, a body over B bytes is a 413."""

from __future__ import annotations

import httpx
import pytest

from tests.utils.serve import Serve


@pytest.mark.slow
def test_serve_flags_reach_the_server(tiny_model: str) -> None:
    server = Serve(
        [tiny_model, "--served-model-name", "tiny", "--no-platform", "--max-model-len", "128",
         "--default-max-tokens", "3"],
        env={"LORAPLEX_MAX_REQUEST_BYTES": "4096"},
    ).start()  # fmt: skip
    try:
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "t5"}],
            "ignore_eos": True,
        }
        r = httpx.post(f"{server.base}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        completion = {"model": "tiny", "prompt": "t5 t6", "ignore_eos": True}
        r = httpx.post(f"{server.base}/v1/completions", json=completion, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16
        big = {**completion, "prompt": "t5 " * 1500}
        r = httpx.post(f"{server.base}/v1/completions", json=big, timeout=60)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
        assert "4096 bytes" in r.json()["error"]["message"]
    finally:
        assert server.stop() == 0
