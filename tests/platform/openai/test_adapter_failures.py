"""An adapter whose engine load fails, seen through the API (issue 30 point 2): requests on it get
422 ``adapter_failed`` naming the version as the tenant knows it (``name@N``), the cause, and what
to do, never the engine's key, a path, or another tenant's name; a stream gets the same error as
its last event; other models keep serving. The operator's retry (API, audited) and a new upload
of the same content make it load again.

The failure is real: the engine (in process, a tiny llama) holds one adapter in host memory, so
the first adapter uploaded is read from disk again at its first request, after the test damaged
its stored file."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from loraplex.engine.inproc_client import InprocEngineClient
from loraplex.platform.db.models import AuditEvent
from tests.utils import registry as rf
from tests.utils.registry import upload
from tests.utils.tenancy import TenancyEnv, bearer, tenancy_env

pytestmark = pytest.mark.anyio
registry_models = rf.registry_models

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
async def env(tmp_path: Path, registry_models: rf.RegistryModels) -> AsyncIterator[TenancyEnv]:
    config = EngineConfig(
        model=ModelConfig(model=registry_models.model_dir, max_model_len=64),
        cache=CacheConfig(block_size=4, num_blocks=64),
        lora=LoRAConfig(max_loras=2, max_cpu_loras=1, max_lora_rank=8),
    )
    engine = InprocEngineClient(config, registry_models.model_dir)
    await engine.start()
    try:
        async with tenancy_env(tmp_path, engine, None) as env:  # type: ignore[arg-type]
            yield env
    finally:
        await engine.shutdown()


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        **extra,
    }


async def _chat_post(env: TenancyEnv, key: str, model: str, **extra: Any) -> httpx.Response:
    return await env.http.post(
        "/v1/chat/completions", json=_chat(model, **extra), headers=bearer(key)
    )


async def _upload(env: TenancyEnv, key: str, name: str, files: dict[str, bytes]) -> str:
    r = await upload(env.http, key, name, files)
    assert r.status_code == 201, r.text
    return str(r.json()["versions"][-1]["content_sha256"])


def _stored(env: TenancyEnv, content: str) -> Path:
    return env.store.data_dir / "adapters" / content / WEIGHTS


async def _damaged(env: TenancyEnv, models: rf.RegistryModels) -> tuple[str, str, str]:
    """acme's "x" (adapter a, uploaded first: out of the engine's host memory once "y" is in)
    with its stored weights truncated; returns (acme's key, x's content hash, y's)."""
    acme = env.tenant("acme")
    x = await _upload(env, acme, "x", models.adapters["a"].files())
    y = await _upload(env, acme, "y", models.adapters["b"].files())
    stored = _stored(env, x)
    stored.write_bytes(stored.read_bytes()[:100])
    return acme, x, y


def _no_internals(text: str, *secrets: str) -> None:
    """No absolute path and none of ``secrets`` (a content hash, the data directory)."""
    assert not re.search(r"(^|[\s'(])/\w", json.loads(text)["error"]["message"]), text
    for secret in secrets:
        assert secret[:10] not in text, text


async def test_a_damaged_adapter_is_a_422_naming_its_version(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    acme, x, _ = await _damaged(env, registry_models)
    for model in ("x", "x@1"):
        r = await _chat_post(env, acme, model)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "adapter_failed" and error["param"] == "model"
        message = error["message"]
        assert message.startswith("The adapter x@1 could not be loaded: ")
        assert "Upload the adapter again as a new version, or ask the operator to retry it" in (
            message
        )
        _no_internals(r.text, x, str(env.store.data_dir))
        assert "acme/" not in message
    # A stream: the same error as its last event, then [DONE].
    r = await _chat_post(env, acme, "x", stream=True)
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "adapter_failed" and error["message"].startswith("The adapter x@1 ")
    # Other models keep serving.
    assert (await _chat_post(env, acme, "y")).status_code == 200
    assert (await _chat_post(env, acme, "tiny-chat")).status_code == 200


async def test_shared_content_fails_in_each_tenants_own_words(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    """acme registered the content first (the engine knows it as acme/x@1): globex's error
    names globex's version and nothing of acme."""
    _, x, _ = await _damaged(env, registry_models)
    globex = env.tenant("globex")
    assert await _upload(env, globex, "mine", registry_models.adapters["a"].files()) == x
    r = await _chat_post(env, globex, "mine")
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith("The adapter mine@1 could not be loaded")
    assert "acme" not in r.text and "x@1" not in r.text


async def test_the_operators_retry_loads_it_again(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    acme, x, _ = await _damaged(env, registry_models)
    assert (await _chat_post(env, acme, "x")).status_code == 422
    _stored(env, x).write_bytes(registry_models.adapters["a"].weights)  # the operator repairs it
    assert (await _chat_post(env, acme, "x")).status_code == 422  # still failed: not retried
    path = "/admin/api/tenants/acme/adapters/x/versions/1/retry"
    assert (await env.http.post(path, headers=bearer(acme))).status_code in (403, 404)
    r = await env.http.post(path, headers=env.admin_headers)
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "x@1", "object": "adapter.version", "had_failed": True}
    assert (await _chat_post(env, acme, "x")).status_code == 200
    r = await env.http.post(path, headers=env.admin_headers)
    assert r.json()["had_failed"] is False
    with env.store.db.session() as session:
        events = session.scalars(
            select(AuditEvent).where(AuditEvent.action == "adapter_version.retry")
        ).all()
        assert [(e.actor, e.object_id, e.tenant_name, e.after) for e in events] == [
            ("admin", "x@1", "acme", {"had_failed": True}),
            ("admin", "x@1", "acme", {"had_failed": False}),
        ]
    r = await env.http.post(
        "/admin/api/tenants/acme/adapters/x/versions/9/retry", headers=env.admin_headers
    )
    assert r.status_code == 404, r.text


async def test_uploading_the_content_again_replaces_the_damaged_files(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    acme, x, _ = await _damaged(env, registry_models)
    assert (await _chat_post(env, acme, "x")).status_code == 422
    assert await _upload(env, acme, "x", registry_models.adapters["a"].files()) == x  # x@2
    assert _stored(env, x).read_bytes() == registry_models.adapters["a"].weights
    assert (await _chat_post(env, acme, "x@2")).status_code == 200
    assert (await _chat_post(env, acme, "x@1")).status_code == 200  # the same content
