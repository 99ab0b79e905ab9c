"""Prefix-cache identity includes the adapter's content hash (and a tenant salt): base and
adapter requests never share KV blocks, a new version of an adapter never hits the old one's
blocks, and the same adapter twice does hit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loraplex import LoRARequest, SamplingParams
from loraplex.llm import LLM
from tests.utils.models import make_adapter, make_tiny_model

PROMPT = list(range(10, 50))  # 40 tokens = 10 full blocks of 4
P = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    root = tmp_path_factory.mktemp("iso")
    model_dir = make_tiny_model(root / "base", "llama", seed=21)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    v1 = make_adapter(model_dir, root / "v1", 8, 16, targets, seed=1)
    v2 = make_adapter(model_dir, root / "v2", 8, 16, targets, seed=2)
    return model_dir, v1, v2


def hits(llm: LLM) -> int:
    return int(llm.engine_stats().prefix_cache_hits)


def blocks_of(llm: LLM) -> set[int]:
    """The KV blocks currently registered in the prefix cache."""
    return set(llm.llm_engine.core.kv._cached.values())


def test_base_and_adapter_never_share_blocks(env: tuple[str, str, str]) -> None:
    model_dir, v1, _ = env
    llm = LLM(model_dir, block_size=4, max_model_len=128)
    llm.generate([PROMPT], P, use_tqdm=False)
    base_blocks = blocks_of(llm)
    assert len(base_blocks) >= 10
    out = llm.generate([PROMPT], P, lora_request=LoRARequest("a", v1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and hits(llm) == 0
    # The adapter's 10 blocks were added beside the base's, which stay cached and untouched.
    assert base_blocks <= blocks_of(llm)
    assert len(blocks_of(llm) - base_blocks) >= 10
    # And the other way round: the base model does not pick up the adapter's blocks.
    again = llm.generate([PROMPT], P, use_tqdm=False)[0]
    assert again.num_cached_tokens == 36  # its own 9 blocks (the last token is recomputed)


def test_same_adapter_twice_hits(env: tuple[str, str, str]) -> None:
    model_dir, v1, _ = env
    llm = LLM(model_dir, block_size=4, max_model_len=128)
    first = llm.generate([PROMPT], P, lora_request=LoRARequest("a", v1), use_tqdm=False)[0]
    second = llm.generate([PROMPT], P, lora_request=LoRARequest("a", v1), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 36
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_readded_adapter_with_new_weights_misses(env: tuple[str, str, str], tmp_path: Path) -> None:
    model_dir, v1, v2 = env
    path = tmp_path / "adapter"
    shutil.copytree(v1, path)
    llm = LLM(model_dir, block_size=4, max_model_len=128)
    req = LoRARequest("same-name", str(path))
    old = llm.generate([PROMPT], P, lora_request=req, use_tqdm=False)[0]
    # Same name, same path, new weights: add it again.
    shutil.rmtree(path)
    shutil.copytree(v2, path)
    llm.add_lora(req)
    new = llm.generate([PROMPT], P, lora_request=req, use_tqdm=False)[0]
    assert new.num_cached_tokens == 0, "a new adapter version must not reuse the old KV"
    assert new.outputs[0].token_ids != old.outputs[0].token_ids
    fresh = LLM(model_dir, block_size=4, max_model_len=128)
    ref = fresh.generate([PROMPT], P, lora_request=LoRARequest("v2", v2), use_tqdm=False)[0]
    assert new.outputs[0].token_ids == ref.outputs[0].token_ids


def test_tenant_salt_separates_identical_prompts(env: tuple[str, str, str]) -> None:
    model_dir, _, _ = env
    llm = LLM(model_dir, block_size=4, max_model_len=128)
    engine = llm.llm_engine
    for rid, salt in (("t1", "tenant-1"), ("t2", "tenant-2"), ("t1b", "tenant-1")):
        engine.add_request(rid, PROMPT, P, cache_extra_keys=(f"salt:{salt}",))
        while engine.has_unfinished_requests():
            engine.step()
    # t2 missed (other tenant), t1b hit its own tenant's 9 blocks.
    assert hits(llm) == 36
