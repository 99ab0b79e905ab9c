"""EngineCore.build: the one engine factory (the offline engine and both clients use it); the
per-tenant part of its stats."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.info import NO_TENANT
from loraplex.engine.request import Request
from loraplex.sampling_params import SamplingParams
from tests.utils.models import make_tiny_model


def test_build_describes_the_core_it_built(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=2)
    config = EngineConfig(
        model=ModelConfig(model=model_dir, max_model_len=96),
        cache=CacheConfig(block_size=8, num_blocks=40),
        lora=LoRAConfig(max_loras=2, max_cpu_loras=3, max_lora_rank=16),
    )
    core, info = EngineCore.build(config, model_dir, tokenizer=SimpleNamespace(eos_token_id=7))
    assert (info.model_dir, info.max_model_len, info.vocab_size) == (
        model_dir,
        core.max_model_len,
        core.vocab_size,
    )
    assert (info.block_size, info.num_blocks) == (8, 39)
    assert (info.max_loras, info.max_cpu_loras, info.max_lora_rank) == (2, 3, 16)
    assert info.lora_target_modules == core.lora_target_modules
    assert info.eos_token_ids == (2, 7)  # the model's, then the tokenizer's
    _, from_dir = EngineCore.build(config, model_dir)  # the tokenizer saved with the model
    assert 2 in from_dir.eos_token_ids


def test_stats_report_each_tenants_service_and_requests(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=3)
    config = EngineConfig(
        model=ModelConfig(model=model_dir, max_model_len=64),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=2, scheduling_policy="fair"),
    )
    core, _ = EngineCore.build(config, model_dir, tokenizer=SimpleNamespace(eos_token_id=None))
    core.set_tenant_weights({"a": 2.0, "idle": 5.0})
    with pytest.raises(ValueError, match="weight of tenant 'a'"):
        core.set_tenant_weights({"a": 0.0})
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for start, (rid, tenant, prompt) in enumerate(
        (("a1", "a", 5), ("a2", "a", 7), ("o1", None, 4))
    ):
        tokens = list(range(10 + 50 * start, 10 + 50 * start + prompt))  # no shared prefix
        core.add_request(Request(rid, tokens, params, tenant=tenant))
    core.step()  # two seats: two requests run, one waits
    mid = core.stats().tenants
    assert sum(t.num_running for t in mid.values()) == 2
    assert sum(t.num_waiting for t in mid.values()) == 1
    while core.has_unfinished_requests():
        core.step()
    stats = core.stats()
    assert set(stats.tenants) == {"a", NO_TENANT, "idle"}
    a, op, idle = stats.tenants["a"], stats.tenants[NO_TENANT], stats.tenants["idle"]
    assert (a.num_prompt_tokens_computed, a.num_generated_tokens) == (12, 6)
    assert (op.num_prompt_tokens_computed, op.num_generated_tokens) == (4, 3)
    assert (a.weight, op.weight, idle.weight) == (2.0, 1.0, 5.0)
    assert a.num_running == a.num_waiting == op.num_running == op.num_waiting == 0
    # All arrived at once (no lift above 0): prompt tokens + 2 x generated, over the weight.
    assert (a.virtual_service, op.virtual_service) == ((12 + 2 * 6) / 2, 4 + 2 * 3)
    assert stats.num_generated_tokens == 9 and stats.num_prompt_tokens_computed == 16
    assert idle.num_generated_tokens == 0 and idle.virtual_service == 0.0


def test_stats_count_requests_not_samples_per_tenant_and_adapter(tmp_path: Path) -> None:
    """``num_*_requests`` count an n > 1 request once, and each tenant's share lists the adapters
    its requests run and wait on (the metrics' ``running_lora_adapters``); none once done."""
    from loraplex.engine.client import build_core_requests
    from loraplex.engine.info import AdapterRequests
    from tests.utils.models import make_adapter

    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=3)
    config = EngineConfig(
        model=ModelConfig(model=model_dir, max_model_len=64),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=2),
        lora=LoRAConfig(max_loras=2, max_cpu_loras=3, max_lora_rank=8),
    )
    core, _ = EngineCore.build(config, model_dir, tokenizer=SimpleNamespace(eos_token_id=None))
    path = make_adapter(model_dir, tmp_path / "bot", 4, 8, ["q_proj", "v_proj"], seed=1)
    key = core.add_lora("bot", path).content_hash
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eos: frozenset[int] = frozenset()
    for rid, tenant, n in (("a1", "a", 2), ("b1", "b", 1), ("b2", "b", 1)):
        sampling = SamplingParams(n=n, max_tokens=4, temperature=1.0, seed=1) if n > 1 else params
        for req in build_core_requests(
            rid, list(range(10, 15)), sampling, eos, lora_key=key, cache_extra_keys=(),
            tenant=tenant,
        ):  # fmt: skip
            core.add_request(req)
    for _ in range(20):  # until the adapter's copy is in: a1 (one sample) and b1 run
        core.step()
        stats = core.stats()
        if stats.num_running:
            break
    # samples: a1's second waits for its leader's prompt, b2 for a seat
    assert (stats.num_running, stats.num_waiting) == (2, 2)
    assert (stats.num_running_requests, stats.num_waiting_requests) == (2, 1)
    assert stats.tenants["a"].adapters == {key: AdapterRequests(running=1, waiting=0)}
    assert stats.tenants["b"].adapters == {key: AdapterRequests(running=1, waiting=1)}
    while core.has_unfinished_requests():
        core.step()
    stats = core.stats()
    assert (stats.num_running_requests, stats.num_waiting_requests) == (0, 0)
    assert all(not t.adapters for t in stats.tenants.values())
