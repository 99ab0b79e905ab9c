"""One engine copy of an adapter, shared by every owner of its content: an owner letting go never
breaks another's requests, a deleted adapter in use goes when its last request ends, and an
engine copy that went missing is added again on the next request. Errors never name the
engine's content hashes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils import registry as rf
from tests.utils.registry import bearer, disk_state, registry_env, upload
from tests.utils.tenancy import TenancyEnv

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models


@pytest.fixture
async def env(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> AsyncIterator[TenancyEnv]:
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        yield env


def _chat(model: str, max_tokens: int = 1) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "t30"}],
        "max_tokens": max_tokens,
    }


async def _chat_status(http: httpx.AsyncClient, token: str, model: str) -> httpx.Response:
    return await http.post("/v1/chat/completions", json=_chat(model), headers=bearer(token))


def _no_hash(response: httpx.Response, key: str) -> None:
    assert key[:8] not in response.text, response.text


async def test_an_operator_unload_of_shared_content_leaves_tenants_serving(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    """The operator loads (and unloads) the content two tenants uploaded: their requests keep
    working throughout, and neither tenant's delete breaks the other."""
    a = registry_models.adapters["a"]
    acme, globex = env.tenant("acme"), env.tenant("globex")
    key = (await upload(env.http, acme, "x", a.files())).json()["versions"][0]["content_sha256"]
    assert (await upload(env.http, globex, "y", a.files())).status_code == 201
    stored = str(env.store.data_dir / "adapters" / key)

    # The operator loads the same content through vLLM's adapter API, and unloads it.
    h = env.admin_headers
    r = await env.http.post(
        "/v1/load_lora_adapter", json={"lora_name": "op", "lora_path": stored}, headers=h
    )
    assert r.status_code == 200 and r.json()["key"] == key, r.text
    r = await env.http.post("/v1/unload_lora_adapter", json={"lora_name": "op"}, headers=h)
    assert r.status_code == 200, r.text
    for token, model in ((acme, "x"), (globex, "y")):
        r = await _chat_status(env.http, token, model)
        assert r.status_code == 200, r.text
        _no_hash(r, key)

    assert (await env.http.delete("/v1/adapters/x", headers=bearer(acme))).status_code == 200
    r = await _chat_status(env.http, globex, "y")
    assert r.status_code == 200, r.text
    assert key in env.fake.adapters and (env.store.data_dir / "adapters" / key).is_dir()

    assert (await env.http.delete("/v1/adapters/y", headers=bearer(globex))).status_code == 200
    assert key not in env.fake.adapters and not (env.store.data_dir / "adapters" / key).exists()


async def test_an_operator_copy_released_under_a_tenant_keeps_the_tenants_copy(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    """The operator adds the content a tenant uses (``--lora-modules``) and removes it again:
    the engine copy stays for the tenant, whose requests never see the engine's key."""
    a = registry_models.adapters["a"]
    acme = env.tenant("acme")
    key = (await upload(env.http, acme, "x", a.files())).json()["versions"][0]["content_sha256"]
    stored = str(env.store.data_dir / "adapters" / key)
    info = await env.fake.add_lora("op", stored)
    assert info.key == key
    await env.fake.remove_lora(key)
    r = await _chat_status(env.http, acme, "x")
    assert r.status_code == 200, r.text
    assert env.fake.submitted[-1].lora_key == key


async def test_a_missing_engine_copy_is_added_again_on_demand(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    engine = env.fake
    assert isinstance(engine, rf.RegistryEngine)
    acme = env.tenant("acme")
    r = await upload(env.http, acme, "x", registry_models.adapters["a"].files())
    key = r.json()["versions"][0]["content_sha256"]
    assert len(engine.add_lora_calls) == 1
    # The engine lost its copy (a restart that could not load it again drops it so).
    engine.lose_adapter(key)
    r = await _chat_status(env.http, acme, "x")
    assert r.status_code == 200, r.text
    assert len(engine.add_lora_calls) == 2 and key in engine.adapters


async def test_deleting_an_adapter_in_use_finishes_when_its_last_request_ends(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    engine = env.fake
    engine.step_delay = 0.02
    acme = env.tenant("acme")
    r = await upload(env.http, acme, "x", registry_models.adapters["a"].files())
    key = r.json()["versions"][0]["content_sha256"]
    before = disk_state(env)
    assert any(key in path for path in before)

    running = asyncio.create_task(
        env.http.post("/v1/chat/completions", json=_chat("x", 20), headers=bearer(acme))
    )
    while not engine.running_on.get(key):  # the request runs on the adapter now
        await asyncio.sleep(0.005)
    r = await env.http.delete("/v1/adapters/x", headers=bearer(acme))
    assert r.status_code == 200, r.text
    r = await _chat_status(env.http, acme, "x")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    _no_hash(r, key)
    assert key in engine.adapters  # the running request still uses it
    done = await running
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 20

    for _ in range(200):  # the removal runs in the background once the request ended
        if key not in engine.adapters and not any(key in p for p in disk_state(env)):
            break
        await asyncio.sleep(0.01)
    assert key not in engine.adapters
    assert not any(key in path for path in disk_state(env)), disk_state(env)


async def test_an_adapter_gone_before_the_engine_runs_it_is_a_404_without_its_key(
    env: TenancyEnv, registry_models: rf.RegistryModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between resolving ``model`` and reaching the engine the adapter can go (its last delete
    raced this request): the answer is the missing model's, never the engine's hash."""
    acme = env.tenant("acme")
    r = await upload(env.http, acme, "x", registry_models.adapters["a"].files())
    key = r.json()["versions"][0]["content_sha256"]
    registry = env.app.platform.tenancy.registry

    async def resolved_but_not_loaded(*args: Any, **kwargs: Any) -> None:
        env.fake.lose_adapter(key)

    monkeypatch.setattr(registry, "ensure_loaded", resolved_but_not_loaded)
    for stream in (False, True):
        body = _chat("x") | {"stream": stream}
        r = await env.http.post("/v1/chat/completions", json=body, headers=bearer(acme))
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
        _no_hash(r, key)
