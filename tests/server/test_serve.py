"""`loraplex serve` end to end: a real subprocess on a free port with a tiny model, driven by the
official openai client; SIGTERM shuts it down cleanly (exit 0); with the platform on, everything
(tenants, keys, adapters) survives a SIGKILL of the server."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from tests.utils.serve import Serve

ADMIN = "lpx-admin-serve-test-0123456789"


@pytest.mark.slow
def test_serve_subprocess_with_openai_client(tiny_model: str, tmp_path: Path) -> None:
    from openai import OpenAI

    server = Serve(
        [tiny_model, "--served-model-name", "tiny", "--api-key", ADMIN, "--max-model-len", "128",
         "--data-dir", str(tmp_path / "data")],
        env={"LORAPLEX_MAX_LORAS": "2"},
    ).start()  # fmt: skip
    try:
        client = OpenAI(base_url=f"{server.base}/v1", api_key=ADMIN)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "t5 t6 t7"}], max_tokens=5, seed=1
        )
        assert chat.choices[0].message.content
        assert chat.usage is not None and 1 <= chat.usage.completion_tokens <= 5
        assert chat.choices[0].finish_reason in ("stop", "length")
        # Streamed text equals non-streamed text for the same seed (sampling, not greedy).
        messages = [{"role": "user", "content": "t9 t10 t11"}]
        whole = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, seed=7, temperature=1.0
        )
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, seed=7, temperature=1.0,
                stream=True,
            )
            if chunk.choices
        )  # fmt: skip
        assert streamed == whole.choices[0].message.content
        assert asyncio.run(_async_completions(server.base)) is True
        assert httpx.get(f"{server.base}/v1/models").status_code == 401
        assert httpx.get(f"{server.base}/admin/login").status_code == 200
    finally:
        code = server.stop()
    assert code == 0


async def _async_completions(base: str) -> bool:
    """The async client: completions streamed (with a usage chunk) and not, same seed."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key=ADMIN)
    kwargs = dict(model="tiny", prompt="t20 t21 t22", max_tokens=10, seed=3, n=2)
    whole = await client.completions.create(**kwargs)  # type: ignore[call-overload]
    texts, usage = ["", ""], None
    stream = await client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[call-overload]
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    await client.close()
    assert texts == [c.text for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    return True


@pytest.mark.slow
def test_platform_state_survives_sigkill(tiny_model: str, tmp_path: Path) -> None:
    """Tenants, keys and adapters made over HTTP are all there after the server is SIGKILLed
    and started again: the same key works and the same adapter name gives the same text."""
    from tests.utils.models import make_adapter

    adapter = make_adapter(tiny_model, tmp_path / "adapter", 4, 8, ["q_proj", "v_proj"], seed=5)
    args = [tiny_model, "--served-model-name", "tiny", "--max-model-len", "128",
            "--data-dir", str(tmp_path / "data")]  # fmt: skip
    env = {"LORAPLEX_ADMIN_TOKEN": ADMIN}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    chat = {"model": "helper", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "t7 t8 t9"}]}  # fmt: skip

    server = Serve(args, env).start()
    try:
        r = httpx.post(f"{server.base}/admin/api/tenants", headers=admin,
                       json={"name": "acme", "quotas": {"requests_per_minute": 100}})  # fmt: skip
        assert r.status_code in (200, 201), r.text
        r = httpx.post(f"{server.base}/admin/api/tenants/acme/keys", headers=admin, json={})
        assert r.status_code in (200, 201), r.text
        key = r.json()["key"]
        tenant = {"Authorization": f"Bearer {key}"}
        files = [
            ("files", ("adapter_config.json", Path(adapter, "adapter_config.json").read_bytes())),
            ("files", ("adapter_model.safetensors",
                       Path(adapter, "adapter_model.safetensors").read_bytes())),
        ]  # fmt: skip
        r = httpx.post(f"{server.base}/v1/adapters", headers=tenant, data={"name": "helper"},
                       files=files, timeout=60)  # fmt: skip
        assert r.status_code in (200, 201), r.text
        before = httpx.post(f"{server.base}/v1/chat/completions", headers=tenant, json=chat,
                            timeout=60)  # fmt: skip
        assert before.status_code == 200, before.text
    finally:
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL

    server = Serve(args, env).start()
    try:
        r = httpx.get(f"{server.base}/admin/api/tenants/acme", headers=admin)
        assert r.status_code == 200 and r.json()["quotas"]["requests_per_minute"] == 100, r.text
        models = httpx.get(f"{server.base}/v1/models", headers=tenant).json()
        assert {"tiny", "helper", "helper@1"} <= {m["id"] for m in models["data"]}
        after = httpx.post(f"{server.base}/v1/chat/completions", headers=tenant, json=chat,
                           timeout=60)  # fmt: skip
        assert after.status_code == 200, after.text
        text = after.json()["choices"][0]["message"]["content"]
        assert text == before.json()["choices"][0]["message"]["content"]
        assert after.json()["model"] == before.json()["model"] == "helper@1"
    finally:
        assert server.stop() == 0
