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
