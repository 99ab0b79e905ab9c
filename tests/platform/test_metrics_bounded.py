"""``/metrics`` stays bounded (issue 31): a tenant's and an adapter version's series go at the
first scrape after they are deleted (``/metrics`` had ~77 series per tenant and ~69 per version,
never removed: +4,620 for 60 short-lived tenants), at most ``metrics_max_tenants`` tenants and
``metrics_max_adapters`` versions get series of their own (the rest are ``_other``), and
``loraplex_adapter_failed`` names each version the engine failed to load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.client import NO_TENANT, TenantStats
from loraplex.platform import tenants
from loraplex.platform.metric_labels import OTHER
from loraplex.platform.settings import ServerSettings
from tests.utils import registry as rf
from tests.utils.metrics import Samples, parse, value
from tests.utils.registry import bearer, registry_env, upload
from tests.utils.tenancy import TenancyEnv

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models

CHAT = {"messages": [{"role": "user", "content": "t30"}], "max_tokens": 2}
TENANT_FAMILIES = ("loraplex_tenant_generated_tokens_total", "loraplex_tenant_requests_running")


async def metrics_text(env: TenancyEnv) -> str:
    r = await env.http.get("/metrics", headers=env.admin_headers)
    assert r.status_code == 200, r.text
    return r.text


def sample_count(text: str) -> int:
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


def tenant_id(env: TenancyEnv, name: str) -> str:
    with env.store.db.session() as session:
        return str(tenants.require_tenant(session, name).id)


async def chat(env: TenancyEnv, key: str, model: str) -> None:
    r = await env.http.post("/v1/chat/completions", json={"model": model, **CHAT},
                            headers=bearer(key))  # fmt: skip
    assert r.status_code == 200, r.text


def labelled(m: Samples, label: str, wanted: str) -> set[str]:
    """The names of the samples with ``label="wanted"``."""
    return {name for (name, labels), _ in m.items() if (label, wanted) in labels}


def report_tenants(env: TenancyEnv, ids: list[str]) -> None:
    """What the engine reports once it served these tenants: it never forgets one."""
    env.fake.engine_stats["tenants"] = {
        **env.fake.engine_stats.get("tenants", {}),
        **{t: TenantStats(1.0, 8, 2, num_running=1, weight=1.0) for t in ids},
    }


async def test_deleting_60_tenants_returns_metrics_to_their_size_before(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        adapter = registry_models.adapters["a"].files()
        keeper = env.tenant("keeper")
        await chat(env, keeper, "tiny-chat")
        report_tenants(env, [tenant_id(env, "keeper")])
        before = await metrics_text(env)

        names = [f"t{i:02d}" for i in range(60)]
        for i, name in enumerate(names):
            key = env.tenant(name)
            await chat(env, key, "tiny-chat")
            if i % 6 == 0:  # 10 of them serve an adapter version too
                assert (await upload(env.http, key, "bot", adapter)).status_code == 201
                await chat(env, key, "bot")
        ids = [tenant_id(env, n) for n in names]
        report_tenants(env, ids)
        during = parse(await metrics_text(env))
        assert labelled(during, "model", "bot@1")  # the adapter's series
        for tid in ids:
            assert "loraplex_requests_total" in labelled(during, "tenant", tid)
            assert set(TENANT_FAMILIES) <= labelled(during, "tenant", tid)
        grown = sum(1 for _ in during) - sample_count(before)
        assert grown > 60 * 70, grown  # about 80 a tenant, 90 more an adapter version

        # Deleted through the admin API, and (the CLI's way) on the database alone.
        for name in names[:30]:
            r = await env.http.delete(f"/admin/api/tenants/{name}", headers=env.admin_headers)
            assert r.status_code == 200, r.text
        with env.store.db.session() as session:
            for name in names[30:]:
                tenants.delete_tenant(session, "admin", tenants.require_tenant(session, name))
        after = await metrics_text(env)
        assert sample_count(after) == sample_count(before), set(parse(after)) - set(parse(before))
        m = parse(after)
        assert not any(labelled(m, "tenant", tid) for tid in ids)
        assert value(m, "loraplex_requests_total", tenant=tenant_id(env, "keeper")) == 1


async def test_a_deleted_version_loses_its_series_and_its_tenant_keeps_its_own(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        files = registry_models.adapters["a"].files()
        key = env.tenant("acme")
        for _ in range(2):  # versions 1 and 2
            assert (await upload(env.http, key, "bot", files)).status_code == 201
        await chat(env, key, "bot@1")
        await chat(env, key, "bot@2")
        m = parse(await metrics_text(env))
        assert labelled(m, "model", "bot@1") and labelled(m, "model", "bot@2")

        r = await env.http.delete("/v1/adapters/bot@1", headers=bearer(key))
        assert r.status_code == 200, r.text
        m = parse(await metrics_text(env))
        assert not labelled(m, "model", "bot@1")
        assert value(m, "loraplex_requests_total", model="bot@2") == 1


async def test_tenants_past_the_cap_are_summed_as_other(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    server = ServerSettings(metrics_max_tenants=3, metrics_max_adapters=1)
    async with registry_env(tmp_path, registry_models, tokenizer, server=server) as env:
        files = registry_models.adapters["a"].files()
        keys = [env.tenant(f"t{i}") for i in range(5)]
        ids = [tenant_id(env, f"t{i}") for i in range(5)]
        for key in keys:
            await chat(env, key, "tiny-chat")
        for key in keys[:2]:  # two versions: the second is past the adapters' cap
            assert (await upload(env.http, key, "bot", files)).status_code == 201
            await chat(env, key, "bot")
        report_tenants(env, [*ids, NO_TENANT])
        m = parse(await metrics_text(env))
        assert value(m, "loraplex_requests_total", tenant=OTHER) == 2
        assert {t for t in ids if labelled(m, "tenant", t)} == set(ids[:3])
        assert value(m, "loraplex_requests_total", tenant=ids[0], model="bot@1") == 1
        assert value(m, "loraplex_requests_total", tenant=ids[1], model=OTHER) == 1
        assert value(m, "loraplex_tenant_generated_tokens_total", tenant=OTHER) == 4
        assert value(m, "loraplex_tenant_requests_running", tenant=OTHER) == 2
        assert not value(m, "loraplex_tenant_weight", tenant=OTHER)  # a weight does not add up
        assert value(m, "loraplex_tenant_generated_tokens_total", tenant=NO_TENANT) == 2
        size = sample_count(await metrics_text(env))

        for i in (0, 4):  # one with its own series, one in _other
            r = await env.http.delete(f"/admin/api/tenants/t{i}", headers=env.admin_headers)
            assert r.status_code == 200, r.text
        m = parse(await metrics_text(env))
        assert not labelled(m, "tenant", ids[0])
        assert value(m, "loraplex_tenant_generated_tokens_total", tenant=OTHER) == 4  # kept
        assert sample_count(await metrics_text(env)) < size
        key = env.tenant("newcomer")  # the freed place
        await chat(env, key, "tiny-chat")
        m = parse(await metrics_text(env))
        assert value(m, "loraplex_requests_total", tenant=tenant_id(env, "newcomer")) == 1


async def test_failed_adapter_versions_are_named(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        key = env.tenant("acme")
        r = await upload(env.http, key, "bot", registry_models.adapters["a"].files())
        content = r.json()["versions"][0]["content_sha256"]
        m = parse(await metrics_text(env))
        assert not [name for name, _ in m if name == "loraplex_adapter_failed"]

        env.fake.engine_stats = {"lora_registered": 2, "lora_failed": {
            content: "out of memory", "f" * 64: "a file went missing"}}  # fmt: skip
        m = parse(await metrics_text(env))
        acme = tenant_id(env, "acme")
        labels = {"tenant": acme, "adapter": "bot", "version": "1"}
        assert value(m, "loraplex_adapter_failed", **labels) == 1
        assert value(m, "loraplex_adapter_failed", tenant=OTHER) == 1  # not the registry's
        assert value(m, "loraplex_adapter_failed") == 2
        assert "out of memory" not in await metrics_text(env)  # reasons are not labels
