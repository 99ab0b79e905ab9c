"""Mixed-adapter batches against PEFT, greedy, fp32 (and bf16 on CPUs with bf16 units): every prompt of one ``generate()`` call, for
the base model or any of 4 adapters (ranks 4/8/16/64, different target modules), gets the tokens
PEFT gives that prompt alone with that adapter. Comparison rule: tests/utils/reference.py (top-5 noise).
"""

from __future__ import annotations

import random

import pytest
import torch

from loraplex import LoRARequest, SamplingParams
from loraplex.kernels import packed_gemm
from loraplex.llm import LLM
from tests.utils.models import make_adapter, make_tiny_model
from tests.utils.reference import TOP, assert_close, greedy_reference, traces

ADAPTERS = {
    # name: (rank, alpha, target_modules)
    "a4": (4, 8, ["q_proj", "v_proj"]),
    "a8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "a16": (16, 8, ["o_proj", "gate_proj", "down_proj"]),
    "a64": (64, 32, r".*\.(k_proj|up_proj)"),
}


def peft_reference(
    model_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_tokens: list[int]
):  # type: ignore[no-untyped-def]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir)
    return greedy_reference(model, prompts, max_tokens)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    model_dir = make_tiny_model(root / "base", arch, seed=11)
    adapters = {
        name: make_adapter(model_dir, root / name, r, a, t, seed=i)
        for i, (name, (r, a, t)) in enumerate(ADAPTERS.items())
    }
    rng = random.Random(3)
    names: list[str | None] = [None, *ADAPTERS] * 4  # 20 prompts: 4 each for base + 4 adapters
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 40))] for _ in names]
    max_tokens = [rng.randint(4, 16) for _ in names]
    refs = {}
    for name in [None, *ADAPTERS]:
        idx = [i for i, n in enumerate(names) if n == name]
        out = peft_reference(
            model_dir,
            None if name is None else adapters[name],
            [prompts[i] for i in idx],
            [max_tokens[i] for i in idx],
        )
        refs.update(zip(idx, out, strict=True))
    ref = [refs[i] for i in range(len(names))]
    return model_dir, adapters, names, prompts, max_tokens, ref


SCENARIOS = {
    "all-slots": dict(max_loras=4),
    # the pool stored in float16 under fp32 activations (half the bytes each step reads)
    "float16-pool": dict(max_loras=4, lora_dtype="float16"),
    "swapping": dict(max_loras=2, max_cpu_loras=2),
    "chunked-preempt": dict(
        max_loras=2, max_num_batched_tokens=9, block_size=4, num_blocks=20, max_model_len=64
    ),
}
# Scenarios whose device pool holds 64 pages per module: the rank-64 adapter fills k_proj and
# up_proj, so it and a8 (which targets every module) evict each other.
SMALL_POOL = ("swapping", "chunked-preempt")
POOL_PAGES = 64


def pool_bytes(model_dir: str, pages: int) -> int:
    """``lora_memory`` for a pool of ``pages`` pages per module on this model."""
    llm = LLM(model_dir, max_model_len=64, dtype="float32")
    mgr = llm.llm_engine.core.runner.lora
    assert mgr is not None and mgr.geometry is not None
    return pages * sum(mgr.geometry.page_bytes.values())


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_mixed_batch_matches_peft(setup, scenario: str) -> None:  # type: ignore[no-untyped-def]
    model_dir, adapters, names, prompts, max_tokens, ref = setup
    knobs = {"max_model_len": 128, "dtype": "float32", **SCENARIOS[scenario]}
    if scenario in SMALL_POOL:
        knobs["lora_memory"] = pool_bytes(model_dir, POOL_PAGES)
    llm = LLM(model_dir, **knobs)  # type: ignore[arg-type]
    loras = [None if n is None else LoRARequest(n, adapters[n]) for n in names]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP)
        for n in max_tokens
    ]
    ours = traces(llm.generate(prompts, params, lora_request=loras, use_tqdm=False))
    labels = [f"prompt {i} ({n or 'base'})" for i, n in enumerate(names)]
    diverged = assert_close(ours, ref, labels)
    assert diverged <= 2, f"{diverged} of {len(names)} sequences diverged within float noise"
    stats = llm.engine_stats()
    if scenario in SMALL_POOL:
        # 4 adapters through 2 slots and a pool too small for all of them: adapters were
        # evicted from the pool and loaded again, and no step waited for a copy
        assert stats.lora.slot_loads >= len(ADAPTERS) > SCENARIOS[scenario]["max_loras"], stats
        assert stats.lora.slot_evictions > 0, stats
        assert stats.lora.load_waits == 0, stats
        assert stats.lora.pool_pages == POOL_PAGES * 7, stats
    tiers = stats.lora.residency
    assert len(tiers) == len(ADAPTERS) and set(tiers.values()) <= {"device", "host", "disk"}
    assert sum(t == "device" for t in tiers.values()) == stats.lora.resident_device, stats
    if scenario == "swapping":
        assert stats.lora.host_evictions > 0 and stats.lora.disk_loads > len(ADAPTERS), stats
    if scenario == "chunked-preempt":
        assert stats.num_preemptions > 0, stats
    if scenario == "float16-pool":  # exactly the adapters' weights, at 2 bytes a value
        from loraplex.lora.adapter import load_adapter

        mgr = llm.llm_engine.core.runner.lora
        assert mgr is not None
        values = sum(
            a.numel() + b.numel()
            for path in adapters.values()
            for a, b in load_adapter(path, mgr.base_info, max_rank=64).weights.values()
        )
        assert stats.lora.pool_bytes_used == stats.lora.adapter_bytes == 2 * values, stats
    assert stats.kv_blocks_used == 0


def test_adapters_change_outputs(setup) -> None:  # type: ignore[no-untyped-def]
    """Guard against a vacuous comparison: each adapter's greedy tokens differ from the base's."""
    model_dir, adapters, *_ = setup
    llm = LLM(model_dir, max_model_len=128)
    prompt = [[5, 6, 7, 8, 9, 10]]
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    base = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids
    for name, path in adapters.items():
        out = llm.generate(prompt, p, lora_request=LoRARequest(name, path), use_tqdm=False)
        assert out[0].outputs[0].token_ids != base, name


@pytest.mark.skipif(
    not packed_gemm.bf16_supported(),
    reason="this CPU has no AVX512-BF16 (or no C compiler): the bf16 path is not built here",
)
def test_mixed_batch_matches_peft_in_bf16(setup) -> None:  # type: ignore[no-untyped-def]
    """The bf16 path (bf16 matrix products, fp32 accumulation and activations) against PEFT
    with a bf16 base model, by the same rule: each side's token among the other's top 5 where
    they differ."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, adapters, names, prompts, max_tokens, _ = setup
    ref: dict[int, object] = {}
    for name in [None, *ADAPTERS]:
        idx = [i for i, n in enumerate(names) if n == name]
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        model = base if name is None else PeftModel.from_pretrained(base, adapters[name])
        out = greedy_reference(model, [prompts[i] for i in idx], [max_tokens[i] for i in idx])
        ref.update(zip(idx, out, strict=True))
    llm = LLM(model_dir, max_model_len=128, dtype="bfloat16", max_loras=4)
    assert llm.llm_engine.core.runner.precision.gemm_dtype == torch.bfloat16
    loras = [None if n is None else LoRARequest(n, adapters[n]) for n in names]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP)
        for n in max_tokens
    ]
    ours = traces(llm.generate(prompts, params, lora_request=loras, use_tqdm=False))
    labels = [f"prompt {i} ({n or 'base'})" for i, n in enumerate(names)]
    diverged = assert_close(ours, [ref[i] for i in range(len(names))], labels)  # type: ignore[misc]
    assert diverged <= len(names) // 2, f"{diverged} of {len(names)} sequences diverged"
