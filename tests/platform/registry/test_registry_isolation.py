"""Two tenants on one server: neither can see, use, version or delete the other's adapters (404
with the very bytes a missing adapter gets), equal uploads share one engine copy but not names,
and prefix-cache keys never cross tenants or versions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils import registry as rf
from tests.utils.registry import bearer, registry_env, upload
from tests.utils.tenancy import TenancyEnv

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models
BASE = "tiny-chat"


@pytest.fixture
async def env(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any, database_url: str | None
) -> AsyncIterator[TenancyEnv]:
    """On SQLite and on PostgreSQL (skipped where it is not installed)."""
    async with registry_env(tmp_path, registry_models, tokenizer, database_url=database_url) as env:
        yield env


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "t30"}], "max_tokens": 1}


async def probes(http: httpx.AsyncClient, token: str, name: str) -> dict[str, httpx.Response]:
    """Every way a tenant could reach the adapter ``name`` (reads first, the delete last)."""
    h = bearer(token)
    out = {
        "get": await http.get(f"/v1/adapters/{name}", headers=h),
        "get@1": await http.get(f"/v1/adapters/{name}@1", headers=h),
        "model": await http.get(f"/v1/models/{name}", headers=h),
        "model@1": await http.get(f"/v1/models/{name}@1", headers=h),
        "chat": await http.post("/v1/chat/completions", json=_chat(name), headers=h),
        "chat@1": await http.post("/v1/chat/completions", json=_chat(f"{name}@1"), headers=h),
        "completion": await http.post(
            "/v1/completions", json={"model": name, "prompt": "t30", "max_tokens": 1}, headers=h
        ),
        "delete@1": await http.delete(f"/v1/adapters/{name}@1", headers=h),
        "delete": await http.delete(f"/v1/adapters/{name}", headers=h),
    }
    return out


async def test_another_tenants_adapter_is_exactly_a_missing_one(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    acme, globex = env.tenant("acme"), env.tenant("globex")
    missing = await probes(env.http, globex, "secret")  # before acme has it
    r = await upload(env.http, acme, "secret", registry_models.adapters["a"].files())
    assert r.status_code == 201, r.text
    key = r.json()["versions"][0]["content_sha256"]
    theirs = await probes(env.http, globex, "secret")
    for probe, response in theirs.items():
        assert response.status_code == 404, (probe, response.text)
        assert response.content == missing[probe].content, probe
        assert response.headers.get("content-type") == missing[probe].headers.get("content-type")
    assert theirs["chat"].json()["error"]["code"] == "model_not_found"
    assert theirs["get"].json()["error"]["code"] == "adapter_not_found"

    r = await env.http.get("/v1/adapters", headers=bearer(globex))
    assert r.json()["data"] == []
    r = await env.http.get("/v1/models", headers=bearer(globex))
    assert [m["id"] for m in r.json()["data"]] == [BASE]
    # acme still has it, untouched by globex's deletes, and can use it
    r = await env.http.get("/v1/models", headers=bearer(acme))
    assert [m["id"] for m in r.json()["data"]] == [BASE, "secret", "secret@1"]
    r = await env.http.post("/v1/chat/completions", json=_chat("secret"), headers=bearer(acme))
    assert r.status_code == 200 and env.fake.submitted[-1].lora_key == key


async def test_same_name_is_a_separate_adapter_and_owner_fields_are_ignored(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    a, b = registry_models.adapters["a"], registry_models.adapters["b"]
    acme, globex = env.tenant("acme"), env.tenant("globex")
    r = await upload(env.http, acme, "bot", a.files())
    key_a = r.json()["versions"][0]["content_sha256"]
    r = await upload(env.http, globex, "bot", b.files(), tenant="acme", owner="acme", tenant_id="1")
    assert r.status_code == 201, r.text
    assert r.json()["owned_by"] == "globex" and r.json()["latest_version"] == 1  # not acme's @2
    key_b = r.json()["versions"][0]["content_sha256"]
    r = await env.http.get("/v1/adapters/bot", headers=bearer(acme))
    assert [(v["id"], v["content_sha256"]) for v in r.json()["versions"]] == [("bot@1", key_a)]
    for token, key in ((acme, key_a), (globex, key_b)):
        r = await env.http.post("/v1/chat/completions", json=_chat("bot"), headers=bearer(token))
        assert r.status_code == 200 and env.fake.submitted[-1].lora_key == key


async def test_equal_uploads_share_one_engine_copy_but_not_names(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    a = registry_models.adapters["a"]
    engine = env.fake
    assert isinstance(engine, rf.RegistryEngine)
    acme, globex = env.tenant("acme"), env.tenant("globex")
    r1 = await upload(env.http, acme, "x", a.files())
    r2 = await upload(env.http, globex, "y", a.files())
    key = r1.json()["versions"][0]["content_sha256"]
    assert r2.json()["versions"][0]["content_sha256"] == key
    assert r2.json()["versions"][0]["status"] == "ready"
    assert len(engine.add_lora_calls) == 1 and list(engine.adapters) == [key]
    for token, own, other in ((acme, "x", "y"), (globex, "y", "x")):
        h = bearer(token)
        assert (
            await env.http.post("/v1/chat/completions", json=_chat(own), headers=h)
        ).status_code == 200
        assert (
            await env.http.post("/v1/chat/completions", json=_chat(other), headers=h)
        ).status_code == 404
    # globex deleting its name keeps acme's copy: files, engine, and acme's requests
    assert (await env.http.delete("/v1/adapters/y", headers=bearer(globex))).status_code == 200
    assert engine.removed == [] and (env.store.data_dir / "adapters" / key).is_dir()
    r = await env.http.post("/v1/chat/completions", json=_chat("x"), headers=bearer(acme))
    assert r.status_code == 200 and engine.submitted[-1].lora_key == key
    assert (await env.http.delete("/v1/adapters/x", headers=bearer(acme))).status_code == 200
    assert engine.removed == [key] and not (env.store.data_dir / "adapters" / key).exists()


async def test_cache_keys_differ_by_tenant_and_by_version(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    a, b = registry_models.adapters["a"], registry_models.adapters["b"]
    acme, globex = env.tenant("acme"), env.tenant("globex")
    await upload(env.http, acme, "bot", a.files())
    await upload(env.http, acme, "bot", b.files())
    submitted = env.fake.submitted
    seen = {}
    for label, token, model in (
        ("v1", acme, "bot@1"),
        ("v2", acme, "bot@2"),
        ("acme-base", acme, BASE),
        ("globex-base", globex, BASE),
    ):
        r = await env.http.post("/v1/chat/completions", json=_chat(model), headers=bearer(token))
        assert r.status_code == 200, r.text
        seen[label] = (submitted[-1].lora_key, submitted[-1].cache_extra_keys)
    # a new version misses the old one's blocks: the engine keys its blocks by content hash
    assert seen["v1"][0] != seen["v2"][0] and None not in (seen["v1"][0], seen["v2"][0])
    assert seen["v1"][1] == seen["v2"][1] == seen["acme-base"][1] != ()
    assert seen["acme-base"][1] != seen["globex-base"][1] != ()  # tenants never share KV


async def test_share_prefix_cache_drops_the_salt_for_the_base_model_only(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    async with registry_env(tmp_path, registry_models, tokenizer, share_prefix_cache=True) as env:
        acme, globex = env.tenant("acme"), env.tenant("globex")
        await upload(env.http, acme, "bot", registry_models.adapters["a"].files())
        keys = []
        for token, model in ((acme, BASE), (globex, BASE), (acme, "bot")):
            h = bearer(token)
            r = await env.http.post("/v1/chat/completions", json=_chat(model), headers=h)
            assert r.status_code == 200, r.text
            keys.append(env.fake.submitted[-1].cache_extra_keys)
        assert keys[0] == keys[1] == ()
        assert keys[2] != ()  # adapter requests stay salted per tenant
