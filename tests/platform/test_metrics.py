"""``GET /metrics``: Prometheus text with bounded labels, counts that match the requests served,
engine numbers at scrape time (monotonic across engine restarts), and who may read it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Request

from loraplex.engine.info import SpecDecodeStats
from loraplex.platform.auth import SCOPE_INFERENCE, Caller
from loraplex.platform.settings import ServerSettings
from loraplex.server import create_app
from tests.utils.app import API_KEY, add_chat_template, sse_events
from tests.utils.asgi import drive_until_disconnect
from tests.utils.fakes import FakeEngineClient
from tests.utils.metrics import Samples, app_for, http, parse, scrape, value

pytestmark = pytest.mark.anyio

BASE = "tiny-chat"
METRICS_TOKEN = "metrics-scraper-token-0123456789"
SECRET_MODEL = "user-typed-secret-model-name"


def label_values(samples: Samples) -> set[str]:
    return {v for (_, ls) in samples for _, v in ls}


@pytest.fixture
async def api(fake: FakeEngineClient, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with http(app_for(fake, tokenizer)) as client:
        yield client


# ---- platform metrics ------------------------------------------------------------------------


async def test_requests_tokens_and_latencies_are_counted(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    fake.queue_time = 0.25
    usages = []
    r = await api.post(
        "/v1/completions", json={"model": BASE, "prompt": "t30 t31", "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    usages.append(r.json()["usage"])
    r = await api.post(
        "/v1/completions", json={"model": BASE, "prompt": "t30", "max_tokens": 2, "n": 2}
    )
    assert r.status_code == 200, r.text
    usages.append(r.json()["usage"])
    chat = {
        "model": BASE,
        "messages": [{"role": "user", "content": "t40"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await api.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    usages.append(sse_events(r.text)[-2]["usage"])
    # Refused: unknown model (404), invalid body before resolution (400), too many tokens (400).
    r = await api.post("/v1/completions", json={"model": SECRET_MODEL, "prompt": "t30"})
    assert r.status_code == 404
    r = await api.post("/v1/completions", json={"model": SECRET_MODEL, "prompt": 7})
    assert r.status_code == 400
    r = await api.post("/v1/completions", json={"model": BASE, "prompt": "t30", "max_tokens": 99})
    assert r.status_code == 400

    m = await scrape(api)
    ok = {"model": BASE, "tenant": "-", "status": "200"}
    assert value(m, "loraplex_requests_total", endpoint="completions", **ok) == 2
    assert value(m, "loraplex_requests_total", endpoint="chat_completions", **ok) == 1
    unresolved = {"model": "_unresolved", "endpoint": "completions"}
    assert value(m, "loraplex_requests_total", status="404", **unresolved) == 1
    assert value(m, "loraplex_requests_total", status="400", **unresolved) == 1
    assert value(m, "loraplex_requests_total", model=BASE, status="400") == 1
    assert value(m, "loraplex_requests_total") == 6

    # Tokens: exactly what the responses' usage said.
    assert [u["completion_tokens"] for u in usages] == [3, 4, 4]
    for metric, field in (("prompt", "prompt"), ("generation", "completion")):
        counted = value(m, f"loraplex_{metric}_tokens_total", model=BASE, tenant="-")
        assert counted == sum(u[f"{field}_tokens"] for u in usages), metric
    assert value(m, "loraplex_prompt_tokens_total", model="_unresolved") == 0

    # One observation per request that ran; all of them produced at least two tokens per choice.
    for histogram in (
        "loraplex_time_to_first_token_seconds",
        "loraplex_time_per_output_token_seconds",
        "loraplex_e2e_request_latency_seconds",
        "loraplex_request_queue_time_seconds",
    ):
        assert value(m, f"{histogram}_count", model=BASE, tenant="-") == 3, histogram
        assert value(m, f"{histogram}_bucket", model=BASE, le="+Inf") == 3, histogram
        assert value(m, f"{histogram}_count", model="_unresolved") == 0, histogram
    assert value(m, "loraplex_request_queue_time_seconds_sum") == pytest.approx(0.75)
    assert value(m, "loraplex_request_queue_time_seconds_bucket", le="0.1") == 0
    ttft = value(m, "loraplex_time_to_first_token_seconds_sum")
    e2e = value(m, "loraplex_e2e_request_latency_seconds_sum")
    assert 0 < ttft <= e2e

    # Bounded labels: the caller's model string is nowhere, not even in the text.
    assert SECRET_MODEL not in label_values(m)
    assert SECRET_MODEL not in (await api.get("/metrics")).text
    assert label_values(m) >= {BASE, "_unresolved", "-", "completions", "chat_completions"}


async def test_an_adapter_is_its_own_model_label(
    api: httpx.AsyncClient, fake: FakeEngineClient, tmp_path: Path
) -> None:
    adapter = tmp_path / "my-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    r = await api.post(
        "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter)}
    )
    assert r.status_code == 200, r.text
    for model in ("sql", "sql", BASE):
        r = await api.post(
            "/v1/completions", json={"model": model, "prompt": "t30", "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
    m = await scrape(api)
    assert value(m, "loraplex_requests_total", model="sql", status="200") == 2
    assert value(m, "loraplex_requests_total", model=BASE, status="200") == 1
    assert value(m, "loraplex_generation_tokens_total", model="sql") == 4
    assert value(m, "loraplex_e2e_request_latency_seconds_count", model="sql") == 2
    assert str(adapter) not in label_values(m)


async def test_a_client_that_leaves_is_counted_as_499(
    fake: FakeEngineClient, tokenizer: Any
) -> None:
    fake.step_delay = 0.02
    app = app_for(fake, tokenizer)
    body = {"model": BASE, "prompt": "t30", "stream": True}
    await drive_until_disconnect(
        app, "/v1/completions", body, lambda sent: sum(1 for s in sent if s.get("body")) >= 3
    )
    async with http(app) as client:
        m = await scrape(client)
    assert value(m, "loraplex_requests_total", model=BASE, status="499") == 1
    assert value(m, "loraplex_requests_total") == 1
    tokens = value(m, "loraplex_generation_tokens_total", model=BASE)
    assert 2 <= tokens < 60  # what it got before leaving, not the 63 it asked for
    assert value(m, "loraplex_e2e_request_latency_seconds_count", model=BASE) == 1
    assert value(m, "loraplex_time_to_first_token_seconds_count", model=BASE) == 1


async def test_an_engine_death_mid_stream_counts_with_its_error_status(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    fake.die_after = 2
    r = await api.post("/v1/completions", json={"model": BASE, "prompt": "t30", "stream": True})
    assert r.status_code == 200 and '"error"' in r.text
    m = await scrape(api)
    assert value(m, "loraplex_requests_total", model=BASE, status="503") == 1
    assert value(m, "loraplex_generation_tokens_total", model=BASE) == 2


async def test_each_app_has_its_own_registry(fake: FakeEngineClient, tokenizer: Any) -> None:
    async with http(app_for(fake, tokenizer)) as one, http(app_for(fake, tokenizer)) as two:
        for _ in range(2):
            r = await one.post(
                "/v1/completions", json={"model": BASE, "prompt": "t30", "max_tokens": 1}
            )
            assert r.status_code == 200
        assert value(await scrape(one), "loraplex_requests_total") == 2
        assert value(await scrape(two), "loraplex_requests_total") == 0


# ---- engine metrics --------------------------------------------------------------------------


ENGINE_STATS: dict[str, Any] = {
    "num_running": 3,
    "num_waiting": 2,
    "num_inflight": 4,
    "kv_cache_usage": 0.25,
    "kv_blocks_used": 16,
    "kv_blocks_total": 64,
    "prefix_cache_queries": 100,
    "prefix_cache_hits": 40,
    "prefix_cache_evictions": 1,
    "num_preemptions": 5,
    "num_steps": 50,
    "num_prompt_tokens_computed": 60,
    "lora_disk_loads": 2,
    "lora_host_evictions": 1,
    "lora_slot_loads": 7,
    "lora_resident_device": 1,
    "lora_resident_host": 2,
    "lora_registered": 3,
    "engine_restarts": 0,
}


async def test_engine_numbers_at_scrape_time(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    fake.engine_stats = dict(ENGINE_STATS)
    m = await scrape(api)
    expected = {
        "loraplex_engine_healthy": 1,
        "loraplex_requests_running": 3,
        "loraplex_requests_waiting": 2,
        "loraplex_engine_inflight_requests": 4,
        "loraplex_kv_cache_usage_ratio": 0.25,
        "loraplex_kv_cache_used_blocks": 16,
        "loraplex_kv_cache_usable_blocks": 64,
        "loraplex_prefix_cache_queries_total": 100,
        "loraplex_prefix_cache_hits_total": 40,
        "loraplex_prefix_cache_hit_rate": 0.4,
        "loraplex_prefix_cache_evictions_total": 1,
        "loraplex_preemptions_total": 5,
        "loraplex_engine_steps_total": 50,
        "loraplex_engine_restarts_total": 0,
    }
    for name, want in expected.items():
        assert value(m, name) == pytest.approx(want), name
    assert value(m, "loraplex_adapter_loads_total", tier="device") == 7
    assert value(m, "loraplex_adapter_loads_total", tier="host") == 2
    assert value(m, "loraplex_adapter_evictions_total", tier="host") == 1
    for tier, want in (("device", 1), ("host", 2), ("disk", 3)):
        assert value(m, "loraplex_adapters_resident", tier=tier) == want


async def test_engine_counters_survive_an_engine_restart(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    fake.engine_stats = dict(ENGINE_STATS)
    assert value(await scrape(api), "loraplex_preemptions_total") == 5
    # The engine process restarted: its own totals start again from zero.
    fake.engine_stats.update(num_preemptions=2, prefix_cache_queries=10, engine_restarts=1)
    m = await scrape(api)
    assert value(m, "loraplex_preemptions_total") == 7
    assert value(m, "loraplex_prefix_cache_queries_total") == 110
    assert value(m, "loraplex_prefix_cache_hits_total") == 80  # 40 before, 40 since
    assert value(m, "loraplex_prefix_cache_hit_rate") == pytest.approx(80 / 110)
    assert value(m, "loraplex_engine_restarts_total") == 1
    fake.engine_stats.update(num_preemptions=3)
    assert value(await scrape(api), "loraplex_preemptions_total") == 8


POOL_STATS: dict[str, Any] = {
    "lora_slot_loads": 9,
    "lora_load_waits": 1,
    "lora_loads_deferred": 4,
    "lora_load_bytes": 3_000_000,
    "lora_loads_in_flight": 2,
    "lora_pool_pages": 1000,
    "lora_pool_pages_used": 250,
    "lora_pool_bytes": 8_000_000,
    "lora_pool_bytes_used": 2_000_000,
    "lora_adapter_bytes": 1_800_000,
    "engine_restarts": 0,
}


async def test_the_adapter_pool_at_scrape_time(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    fake.engine_stats = dict(POOL_STATS)
    m = await scrape(api)
    assert value(m, "loraplex_adapter_pool_pages", state="used") == 250
    assert value(m, "loraplex_adapter_pool_pages", state="free") == 750
    assert value(m, "loraplex_adapter_pool_bytes", state="used") == 2_000_000
    assert value(m, "loraplex_adapter_pool_bytes", state="free") == 6_000_000
    assert value(m, "loraplex_adapter_weight_bytes") == 1_800_000
    assert value(m, "loraplex_adapter_loads_in_flight") == 2
    assert value(m, "loraplex_adapter_load_waits_total") == 1
    assert value(m, "loraplex_adapter_loads_deferred_total") == 4
    assert value(m, "loraplex_adapter_load_bytes_total") == 3_000_000
    assert value(m, "loraplex_adapter_loads_total", tier="device") == 9

    # The engine restarted with an empty pool: the counters go on, the gauges are the new ones.
    fake.engine_stats = {
        **POOL_STATS,
        "lora_slot_loads": 1,
        "lora_load_waits": 0,
        "lora_loads_deferred": 1,
        "lora_load_bytes": 500_000,
        "lora_loads_in_flight": 0,
        "lora_pool_pages_used": 0,
        "lora_pool_bytes_used": 0,
        "lora_adapter_bytes": 0,
        "engine_restarts": 1,
    }
    m = await scrape(api)
    assert value(m, "loraplex_adapter_load_waits_total") == 1
    assert value(m, "loraplex_adapter_loads_deferred_total") == 5
    assert value(m, "loraplex_adapter_load_bytes_total") == 3_500_000
    assert value(m, "loraplex_adapter_loads_total", tier="device") == 10
    assert value(m, "loraplex_adapter_pool_pages", state="free") == 1000
    assert value(m, "loraplex_adapter_pool_bytes", state="used") == 0
    assert value(m, "loraplex_adapter_weight_bytes") == 0

    fake.alive = False  # no answer: the pool's gauges go, its counters stay
    m = await scrape(api)
    assert value(m, "loraplex_adapter_load_bytes_total") == 3_500_000
    gone = {"loraplex_adapter_pool_pages", "loraplex_adapter_pool_bytes"}
    gone |= {"loraplex_adapter_weight_bytes", "loraplex_adapter_loads_in_flight"}
    assert not [name for name, _ in m if name in gone]


async def test_an_engine_without_adapters_has_no_pool_series(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    fake.engine_stats = {"num_running": 1}  # LoRA off: no LoRAStats at all
    m = await scrape(api)
    assert value(m, "loraplex_requests_running") == 1
    assert not [name for name, _ in m if name.startswith("loraplex_adapter")]


async def test_speculative_decoding_counters_by_method_across_a_restart(
    api: httpx.AsyncClient, fake: FakeEngineClient
) -> None:
    fake.engine_stats = dict(ENGINE_STATS)
    m = await scrape(api)
    assert not [k for k in m if k[0].startswith("loraplex_spec_decode")]  # no speculation
    spec = SpecDecodeStats(
        "ngram", num_verifications=10, num_draft_tokens=40, num_accepted_tokens=30,
        num_emitted_tokens=38,
    )  # fmt: skip
    fake.engine_stats = dict(ENGINE_STATS, speculative=spec)
    m = await scrape(api)
    assert value(m, "loraplex_spec_decode_draft_tokens_total", method="ngram") == 40
    assert value(m, "loraplex_spec_decode_accepted_tokens_total", method="ngram") == 30
    assert value(m, "loraplex_spec_decode_emitted_tokens_total", method="ngram") == 38
    assert value(m, "loraplex_spec_decode_verifications_total", method="ngram") == 10
    assert value(m, "loraplex_spec_decode_acceptance_rate", method="ngram") == 0.75
    restarted = SpecDecodeStats("ngram", num_verifications=1, num_draft_tokens=10)
    fake.engine_stats = dict(ENGINE_STATS, speculative=restarted, engine_restarts=1)
    m = await scrape(api)
    assert value(m, "loraplex_spec_decode_draft_tokens_total", method="ngram") == 50
    assert value(m, "loraplex_spec_decode_acceptance_rate", method="ngram") == 30 / 50


async def test_a_dead_or_hung_engine_still_gets_scraped(
    fake: FakeEngineClient, tokenizer: Any
) -> None:
    fake.engine_stats = dict(ENGINE_STATS)
    app = app_for(fake, tokenizer)
    async with http(app) as api:
        r = await api.post(
            "/v1/completions", json={"model": BASE, "prompt": "t30", "max_tokens": 2}
        )
        assert r.status_code == 200
        assert value(await scrape(api), "loraplex_engine_healthy") == 1
        fake.alive = False
        m = await scrape(api)
        assert value(m, "loraplex_engine_healthy") == 0
        assert value(m, "loraplex_requests_total", model=BASE, status="200") == 1
        assert not any(name == "loraplex_requests_running" for name, _ in m)  # no stale gauges
        assert value(m, "loraplex_preemptions_total") == 5  # the last known total
        fake.alive = True
        fake.stats_delay = 1.0
        app.platform.metrics.stats_timeout = 0.05
        m = await scrape(api)
        assert value(m, "loraplex_engine_healthy") == 0


# ---- who may read it -------------------------------------------------------------------------


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


async def expect_401(client: httpx.AsyncClient, headers: dict[str, str]) -> None:
    r = await client.get("/metrics", headers=headers)
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "metrics token" in error["message"] and error["code"] in (
        "missing_api_key",
        "invalid_api_key",
    )
    assert r.headers["www-authenticate"] == "Bearer"
    assert "loraplex_" not in r.text


async def test_an_open_server_serves_metrics_openly(api: httpx.AsyncClient) -> None:
    assert value(await scrape(api), "loraplex_engine_healthy") == 1


async def test_the_operator_key_reads_metrics(fake: FakeEngineClient, tokenizer: Any) -> None:
    async with http(app_for(fake, tokenizer, api_key=API_KEY)) as client:
        await expect_401(client, {})
        await expect_401(client, bearer("sk-wrong"))
        await expect_401(client, bearer(METRICS_TOKEN))  # no metrics token configured
        await scrape(client, **bearer(API_KEY))


async def test_the_metrics_token_reads_metrics(fake: FakeEngineClient, tokenizer: Any) -> None:
    async with http(app_for(fake, tokenizer, metrics_token=METRICS_TOKEN)) as client:
        await expect_401(client, {})  # the API is open, but /metrics is not
        await expect_401(client, bearer("sk-anything"))
        await scrape(client, **bearer(METRICS_TOKEN))
        r = await client.post("/v1/completions", json={"model": BASE, "prompt": "t30"})
        assert r.status_code == 200  # the token guards /metrics only
    app = app_for(fake, tokenizer, api_key=API_KEY, metrics_token=METRICS_TOKEN)
    async with http(app) as client:
        await scrape(client, **bearer(METRICS_TOKEN))
        await scrape(client, **bearer(API_KEY))
        await expect_401(client, bearer("sk-wrong"))
        r = await client.post(
            "/v1/completions", json={"model": BASE, "prompt": "t30"}, headers=bearer(METRICS_TOKEN)
        )
        assert r.status_code == 401  # and reads /metrics only


async def test_a_caller_without_the_admin_scope_is_refused(
    fake: FakeEngineClient, tokenizer: Any
) -> None:
    class InferenceOnly:
        async def authenticate(self, request: Request) -> Caller:
            return Caller(
                id="tenant:t1/key:k1", scopes=frozenset({SCOPE_INFERENCE}), tenant_id="t1"
            )

    app = create_app(fake, ServerSettings(), tokenizer=tokenizer, authenticator=InferenceOnly())
    async with http(app) as client:
        r = await client.get("/metrics")
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
        r = await client.post(
            "/v1/completions", json={"model": BASE, "prompt": "t30", "max_tokens": 1}
        )
        assert r.status_code == 200
    # The tenant id is the tenant label (registry ids are bounded; "-" for the operator).
    m = parse((await app.platform.metrics.scrape()).decode())
    assert value(m, "loraplex_requests_total", tenant="t1", status="200") == 1


def test_an_empty_metrics_token_is_refused() -> None:
    with pytest.raises(ValueError, match="metrics_token"):
        ServerSettings(metrics_token="")


# ---- the real in-process engine --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.utils.models import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("engine") / "tiny-llama-chat", "llama", seed=3)
    add_chat_template(path)
    return path


async def test_real_engine_queue_time_kv_and_prefix_metrics(tiny_chat_model: str) -> None:
    from loraplex.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from loraplex.engine.inproc_client import InprocEngineClient

    config = EngineConfig(
        model=ModelConfig(model=tiny_chat_model, max_model_len=256),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=1),  # one at a time: the others queue
    )
    engine = InprocEngineClient(config, tiny_chat_model)
    await engine.start()
    app = create_app(engine, ServerSettings(served_model_name="tiny"))
    prompt = " ".join(f"t{30 + i}" for i in range(40))  # 2 full blocks shared by all three
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "ignore_eos": True}
    try:
        async with http(app) as api:
            first = asyncio.ensure_future(api.post("/v1/completions", json=body))
            for _ in range(500):  # scrape while it runs
                m = await scrape(api)
                if value(m, "loraplex_requests_running") >= 1:
                    break
                await asyncio.sleep(0.01)
            assert value(m, "loraplex_kv_cache_usage_ratio") > 0
            assert value(m, "loraplex_kv_cache_used_blocks") >= 3
            rest = [asyncio.ensure_future(api.post("/v1/completions", json=body)) for _ in "ab"]
            for r in await asyncio.gather(first, *rest):
                assert r.status_code == 200, r.text
            m = await scrape(api)
    finally:
        await engine.shutdown()
    assert value(m, "loraplex_engine_healthy") == 1
    assert value(m, "loraplex_request_queue_time_seconds_count", model="tiny") == 3
    # The later two waited for the one running before them (max_num_seqs=1).
    assert value(m, "loraplex_request_queue_time_seconds_sum") > 0.001
    assert value(m, "loraplex_time_per_output_token_seconds_count", model="tiny") == 3
    assert value(m, "loraplex_generation_tokens_total", model="tiny") == 72
    assert value(m, "loraplex_prefix_cache_queries_total") >= 3 * 40
    assert value(m, "loraplex_prefix_cache_hits_total") >= 2 * 32
    assert 0 < value(m, "loraplex_prefix_cache_hit_rate") < 1
    assert value(m, "loraplex_kv_cache_usage_ratio") == 0  # all finished: nothing held
    assert value(m, "loraplex_kv_cache_usable_blocks") == 63
    assert value(m, "loraplex_requests_running") == value(m, "loraplex_requests_waiting") == 0
