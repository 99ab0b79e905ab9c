"""The adapter cache through the engine: tiers, LRU host eviction, pinning, removal rules,
loading adapters while requests run, and bad adapters refused at add time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex import LoRARequest, SamplingParams
from loraplex.config import LoRAConfig
from loraplex.engine.models import ARCHITECTURES, LlamaForCausalLM
from loraplex.engine.models.layers import Linear
from loraplex.kernels.lora_ops import TorchLoRACache
from loraplex.llm import LLM
from loraplex.lora.adapter import SUPPORTED_MODULES, AdapterError
from loraplex.lora.layers import LoRALinear
from loraplex.lora.manager import LoRAManager
from tests.utils.models import make_adapter, make_tiny_model

P = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    root = tmp_path_factory.mktemp("mgr")
    model_dir = make_tiny_model(root / "base", "llama", seed=8)
    adapters = [
        make_adapter(model_dir, root / f"a{i}", 4, 8, ["q_proj", "v_proj"], seed=i)
        for i in range(4)
    ]
    return model_dir, adapters


def test_host_lru_eviction_and_reload_from_disk(env: tuple[str, list[str]]) -> None:
    model_dir, adapters = env
    llm = LLM(model_dir, max_loras=1, max_cpu_loras=2, max_model_len=64)
    mgr = llm.llm_engine.core.adapters
    assert mgr is not None
    keys = [llm.add_lora(LoRARequest(f"a{i}", p)) for i, p in enumerate(adapters)]
    assert [mgr.tier_of(k) for k in keys] == ["disk", "disk", "host", "host"]
    assert mgr.stats.host_evictions == 2
    ref = llm.generate([[5, 6, 7]], P, lora_request=LoRARequest("a0", adapters[0]), use_tqdm=False)
    assert mgr.tier_of(keys[0]) == "device"  # reloaded from disk into host, then into slot 0
    stats = llm.engine_stats().lora
    assert stats is not None and stats.disk_loads == 5
    # The same output again, served from the slot without copying weights.
    loads = mgr.stats.slot_loads
    again = llm.generate(
        [[5, 6, 7]], P, lora_request=LoRARequest("a0", adapters[0]), use_tqdm=False
    )
    assert again[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert mgr.stats.slot_loads == loads


def test_pinned_adapters_stay_in_the_device_pool_and_host_memory(
    env: tuple[str, list[str]],
) -> None:
    model_dir, adapters = env
    # A pool of 8 pages per module holds two of these rank-4 adapters: the pinned one and one
    # more, so x2 must evict x1 (the pinned one is older and would go first if it could).
    probe = LLM(model_dir, max_model_len=64).llm_engine.core.runner.lora
    assert probe is not None and probe.geometry is not None
    page_set = sum(probe.geometry.page_bytes.values())
    llm = LLM(model_dir, max_loras=1, max_cpu_loras=1, max_model_len=64, lora_memory=8 * page_set)
    engine = llm.llm_engine
    pinned = engine.core.add_lora("p", adapters[0], pinned=True).content_hash
    mgr = engine.core.adapters
    assert mgr is not None and mgr.tier_of(pinned) == "device"  # loaded at once
    for i in (1, 2):
        llm.generate([[5, 6, 7]], P, lora_request=LoRARequest(f"x{i}", adapters[i]), use_tqdm=False)
    stats = llm.engine_stats().lora
    assert stats is not None and stats.slot_evictions >= 1  # x1 made room for x2
    assert mgr.tier_of(pinned) == "device"
    assert pinned in mgr.tiers() and stats.host_evictions >= 1


def test_remove_refused_while_in_use_then_allowed(env: tuple[str, list[str]]) -> None:
    model_dir, adapters = env
    llm = LLM(model_dir, max_model_len=64)
    engine = llm.llm_engine
    key = engine.add_lora("busy", adapters[1])
    engine.add_request(
        "r1", [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True), lora_key=key
    )
    engine.step()
    with pytest.raises(ValueError, match="in use by 1 request"):
        engine.remove_lora(key)
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora(key)
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("r2", [5, 6, 7], P, lora_key=key)


def test_adapter_added_while_requests_run(env: tuple[str, list[str]]) -> None:
    model_dir, adapters = env
    llm = LLM(model_dir, max_model_len=64)
    engine = llm.llm_engine
    engine.add_request(
        "base", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    )
    engine.step()
    key = engine.add_lora("late", adapters[2])
    engine.add_request("lora", [5, 6, 7], P, lora_key=key)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    ref = LLM(model_dir, max_model_len=64).generate(
        [[5, 6, 7]], P, lora_request=LoRARequest("late", adapters[2]), use_tqdm=False
    )
    assert done["lora"] == ref[0].outputs[0].token_ids
    assert len(done["base"]) == 12


def test_bad_adapter_refused_with_its_error(env: tuple[str, list[str]], tmp_path: Path) -> None:
    model_dir, adapters = env
    llm = LLM(model_dir, max_model_len=64, max_lora_rank=2)
    with pytest.raises(AdapterError) as err:
        llm.generate([[5, 6]], P, lora_request=LoRARequest("big", adapters[0]), use_tqdm=False)
    assert err.value.code == "rank_too_large"
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(AdapterError) as err:
        llm.add_lora(LoRARequest("missing", str(tmp_path / "nope")))
    assert err.value.code == "missing_file"


def test_an_adapter_larger_than_the_pool_is_refused_at_add_time(
    env: tuple[str, list[str]],
) -> None:
    model_dir, adapters = env
    probe = LLM(model_dir, max_model_len=64).llm_engine.core.runner.lora
    assert probe is not None and probe.geometry is not None
    page_set = sum(probe.geometry.page_bytes.values())
    llm = LLM(model_dir, max_model_len=64, lora_memory=2 * page_set)  # 2 pages: rank 4 won't fit
    with pytest.raises(AdapterError, match="needs 4 pages; the pool has 2") as err:
        llm.add_lora(LoRARequest("a0", adapters[0]))
    assert err.value.code == "pool_too_small" and "--lora-memory" in str(err.value)
    stats = llm.engine_stats().lora
    assert stats is not None and stats.registered == 0 and stats.pool_pages_used == 0


def test_a_float16_pool_refuses_weights_beyond_its_range(
    env: tuple[str, list[str]], tmp_path: Path
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir, adapters = env
    big = tmp_path / "big"
    shutil.copytree(adapters[0], big)
    weights = load_file(str(big / "adapter_model.safetensors"))
    name = next(k for k in weights if "lora_B" in k)
    weights[name] = weights[name] * 1e6
    save_file(weights, str(big / "adapter_model.safetensors"))
    llm = LLM(model_dir, max_model_len=64, lora_dtype="float16")
    with pytest.raises(AdapterError, match=r"beyond float16's range.*--lora-dtype bfloat16") as err:
        llm.add_lora(LoRARequest("big", str(big)))
    assert err.value.code == "bad_dtype"
    LLM(model_dir, max_model_len=64, lora_dtype="bfloat16").add_lora(LoRARequest("big", str(big)))


def test_slot_reload_drops_prepared_weights(env: tuple[str, list[str]]) -> None:
    """One slot serves a0, then a1, then a0 again: each change rewrites the slot's page-index
    row and drops what the LoRA kernels prepared from it, so every output is the one a fresh
    engine gives. Both adapters stay in the pool: the third request copies nothing."""
    model_dir, adapters = env
    names = ["a0", "a1", "a0"]
    llm = LLM(model_dir, max_loras=1, max_model_len=64)
    mgr = llm.llm_engine.core.runner.lora
    residency = llm.llm_engine.core.adapters
    assert mgr is not None and residency is not None
    ours, versions = [], []
    for name in names:
        req = LoRARequest(name, adapters[int(name[1])])
        ours.append(llm.generate([[5, 6, 7]], P, lora_request=req, use_tqdm=False))
        layer = mgr.layers[0][1]
        assert layer.weights is not None
        versions.append(TorchLoRACache.of(layer.weights).version)
    assert residency.stats.slot_loads == 2
    assert versions[0] < versions[1] < versions[2]
    for name, out in zip(names, ours, strict=True):
        fresh = LLM(model_dir, max_model_len=64).generate(
            [[5, 6, 7]], P, lora_request=LoRARequest(name, adapters[int(name[1])]), use_tqdm=False
        )
        assert out[0].outputs[0].token_ids == fresh[0].outputs[0].token_ids, name


def tiny_config(arch: str) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch](**common)


ARCH_OF = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama"}
ARCH_OF |= {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_model_class_declares_its_lora_targets(name: str) -> None:
    cls = ARCHITECTURES[name]
    targets = cls.lora_targets()
    assert tuple(targets) == cls.lora_modules
    # together they are exactly the modules adapter validation accepts, in the same order
    assert tuple(m for names in targets.values() for m in names) == SUPPORTED_MODULES
    model = cls(tiny_config(ARCH_OF[name]), 64, torch.float32, torch.device("cpu"))
    for layer in model.model.layers:
        for path, names in targets.items():
            linear = layer.get_submodule(path)
            assert isinstance(linear, Linear)
            shards = list(linear.output_slices)  # a plain linear's one slice is unnamed
            assert shards == names or (shards == [""] and names == [path.rpartition(".")[2]])


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_the_manager_wraps_exactly_the_declared_modules(name: str) -> None:
    cls = ARCHITECTURES[name]
    model = cls(tiny_config(ARCH_OF[name]), 64, torch.float32, torch.device("cpu"))
    mgr = LoRAManager(model, model.config, LoRAConfig(), 16, torch.device("cpu"))
    wrapped = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    want = {f"model.layers.{i}.{p}" for i in range(2) for p in cls.lora_modules}
    assert set(wrapped) == want and len(mgr.layers) == len(want)
    for path, names in cls.lora_targets().items():
        assert wrapped[f"model.layers.0.{path}"].module_names == names
    assert mgr.target_modules == SUPPORTED_MODULES


class AttentionOnly(LlamaForCausalLM):
    lora_modules = ("self_attn.qkv_proj", "self_attn.o_proj")


def test_the_manager_reads_the_targets_from_the_model() -> None:
    model = AttentionOnly(tiny_config("llama"), 64, torch.float32, torch.device("cpu"))
    mgr = LoRAManager(model, model.config, LoRAConfig(), 16, torch.device("cpu"))
    assert mgr.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert not isinstance(model.model.layers[0].mlp.down_proj, LoRALinear)
    assert isinstance(model.model.layers[1].self_attn.o_proj, LoRALinear)
