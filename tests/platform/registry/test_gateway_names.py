"""Gateway mode (``--gateway-mode``): a tenant's adapter is ``<tenant>/<name>[@N]``, one string per
adapter across tenants, the same in the ``model`` field, ``/v1/models``, responses and the
metrics' ``running_lora_adapters``; two tenants may both have a ``bot``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.info import AdapterRequests, TenantStats
from loraplex.platform import tenants
from loraplex.platform.registry.resolver import RegistryModels
from tests.utils import registry as rf
from tests.utils.registry import bearer, registry_env, upload
from tests.utils.tenancy import TenancyEnv

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models
BASE = "tiny-chat"


@pytest.fixture
async def env(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> AsyncIterator[TenancyEnv]:
    async with registry_env(tmp_path, registry_models, tokenizer, gateway_mode=True) as env:
        yield env


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "t30"}], "max_tokens": 1}


def _tenant_id(env: TenancyEnv, name: str) -> int:
    with env.store.db.session() as session:
        return tenants.require_tenant(session, name).id


async def test_gateway_names_are_tenant_slash_name_everywhere(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    a, b = registry_models.adapters["a"], registry_models.adapters["b"]
    acme, globex = env.tenant("acme"), env.tenant("globex")
    for token, files in ((acme, a), (acme, b), (globex, a)):  # acme: bot@1 = a, bot@2 = b
        r = await upload(env.http, token, "bot", files.files())
        assert r.status_code == 201, r.text

    r = await env.http.get("/v1/models", headers=bearer(acme))
    assert {m["id"] for m in r.json()["data"]} == {BASE, "acme/bot", "acme/bot@1", "acme/bot@2"}
    r = await env.http.post("/v1/chat/completions", json=_chat("acme/bot"), headers=bearer(acme))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "acme/bot@2"
    r = await env.http.post(
        "/v1/chat/completions", json=_chat("globex/bot"), headers=bearer(globex)
    )
    assert r.status_code == 200 and r.json()["model"] == "globex/bot@1", r.text
    missing = await env.http.post("/v1/chat/completions", json=_chat("nobot"), headers=bearer(acme))
    assert missing.status_code == 404
    for name in ("bot", "bot@1", "globex/bot", "acme/bot@3", "acme/", "/bot", "acme/acme/bot"):
        r = await env.http.post("/v1/chat/completions", json=_chat(name), headers=bearer(acme))
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found"), name

    # The metrics name what runs by the same strings, per tenant even for equal content.
    models = env.app.platform.resolver.tenant_models
    assert isinstance(models, RegistryModels)
    # The registry's cards give the same strings (its routes keep the plain name in the path).
    card = (await env.http.get("/v1/adapters/bot", headers=bearer(acme))).json()
    assert (card["id"], card["model"]) == ("bot", "acme/bot")
    assert [v["model"] for v in card["versions"]] == ["acme/bot@1", "acme/bot@2"]
    hashes = {f"bot@{v['number']}": v["content_sha256"] for v in card["versions"]}
    ha, hb = hashes["bot@1"], hashes["bot@2"]
    ia, ig = _tenant_id(env, "acme"), _tenant_id(env, "globex")
    names = await models.served_names([(ia, ha), (ia, hb), (ig, ha), (ig, hb)])
    assert names == {
        (ia, ha): ("acme/bot@1",),
        (ia, hb): ("acme/bot", "acme/bot@2"),
        (ig, ha): ("globex/bot", "globex/bot@1"),
    }

    env.fake.engine_stats = {
        "num_running_requests": 2,
        "num_waiting_requests": 1,
        "kv_cache_usage": 0.25,
        "kv_blocks_total": 64,
        "block_size": 16,
        "lora_registered": 2,
        "tenants": {
            str(ia): TenantStats(adapters={hb: AdapterRequests(running=1, waiting=1)}),
            str(ig): TenantStats(adapters={ha: AdapterRequests(running=1)}),
        },
    }
    r = await env.http.get("/metrics", headers=env.admin_headers)
    assert r.status_code == 200, r.text
    (info,) = [
        s
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
        if s.name == "vllm:lora_requests_info"
    ]
    assert info.labels["model_name"] == BASE
    assert info.labels["running_lora_adapters"] == "acme/bot,acme/bot@2,globex/bot,globex/bot@1"
    assert info.labels["waiting_lora_adapters"] == "acme/bot,acme/bot@2"
