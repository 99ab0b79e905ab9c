"""`loraplex serve` end to end: a real subprocess on a free port with a tiny model, driven by the
official openai client; SIGTERM shuts it down cleanly (exit 0)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_tiny_model
from tests.platform.conftest import add_chat_template


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_serve_subprocess_with_openai_client(tmp_path: Path) -> None:
    from openai import OpenAI

    model_dir = make_tiny_model(tmp_path / "tiny", "llama", seed=3)
    add_chat_template(model_dir)
    port = _free_port()
    env = {**os.environ, "LORAPLEX_MAX_LORAS": "2", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", "serve", model_dir, "--port", str(port),
         "--served-model-name", "tiny", "--api-key", "sk-test", "--max-model-len", "128"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("server did not become healthy in 120 s")
        client = OpenAI(base_url=f"{base}/v1", api_key="sk-test")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "t5 t6 t7"}], max_tokens=5, seed=1
        )
        assert chat.choices[0].message.content
        assert chat.usage is not None and 1 <= chat.usage.completion_tokens <= 5
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert httpx.get(f"{base}/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0
