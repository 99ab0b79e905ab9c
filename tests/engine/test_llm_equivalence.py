"""loraplex against Hugging Face transformers, greedy, fp32, token for token.

Comparison rule (as vLLM's ``check_logprobs_close``): walk both sequences; where the tokens
differ, the two candidates must be within float noise of each other, i.e. each side's token is
among the other side's top-5 logprobs, and the comparison stops there (the sequences diverge).
With these tiny random models that almost never triggers; the test counts how often it does.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loraplex import SamplingParams
from loraplex.llm import LLM
from tests.conftest import make_tiny_model

TOP = 5


def hf_greedy(
    model_dir: str, prompts: list[list[int]], max_tokens: list[int]
) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each prompt alone through transformers with its KV cache, greedy, top-5 logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids, past = torch.tensor([prompt]), None
            tokens, tops = [], []
            for _ in range(n):
                out = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                v, i = lp.topk(TOP)
                tops.append(dict(zip(i.tolist(), v.tolist(), strict=True)))
                tokens.append(int(i[0]))
                ids = i[:1].view(1, 1)
            results.append((tokens, tops))
    return results


def assert_close(
    ours: list[tuple[list[int], list[dict[int, float]]]],
    ref: list[tuple[list[int], list[dict[int, float]]]],
) -> int:
    """Returns how many sequences diverged within float noise; fails on a real mismatch."""
    diverged = 0
    for i, ((a_tok, a_top), (b_tok, b_top)) in enumerate(zip(ours, ref, strict=False)):
        assert len(a_tok) == len(b_tok), f"prompt {i}: {len(a_tok)} vs {len(b_tok)} tokens"
        for pos, (a, b) in enumerate(zip(a_tok, b_tok, strict=False)):
            if a == b:
                continue
            assert a in b_top[pos] and b in a_top[pos], (
                f"prompt {i} position {pos}: loraplex {a} vs HF {b} "
                f"(loraplex top-5 {a_top[pos]}, HF top-5 {b_top[pos]})"
            )
            diverged += 1
            break
    return diverged


def run_ours(
    llm: LLM, prompts: list[list[int]], max_tokens: list[int]
) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP)
        for n in max_tokens
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        result.append((c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]))
    return result


def workload(seed: int, n: int = 16, shared_prefix: int = 37) -> tuple[list[list[int]], list[int]]:
    """16 prompts of 1-48 tokens; every other one starts with the same shared prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(shared_prefix)]
    prompts = [
        (prefix if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 48))]
        for i in range(n)
    ]
    return prompts, [rng.randint(4, 24) for _ in range(n)]


MODELS = [
    pytest.param(
        "llama", 0, dict(num_key_value_heads=2, tie_word_embeddings=True), id="llama-gqa-tied-s0"
    ),
    pytest.param(
        "llama", 1, dict(num_key_value_heads=4, tie_word_embeddings=False), id="llama-mha-untied-s1"
    ),
    pytest.param(
        "llama",
        2,
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
        id="llama3-rope-s2",
    ),
    pytest.param(
        "qwen2", 3, dict(num_key_value_heads=2, tie_word_embeddings=False), id="qwen2-gqa-s3"
    ),
    pytest.param(
        "qwen2", 4, dict(num_key_value_heads=1, tie_word_embeddings=True), id="qwen2-mqa-tied-s4"
    ),
    pytest.param(
        "qwen3", 5, dict(num_key_value_heads=2, tie_word_embeddings=False), id="qwen3-gqa-s5"
    ),
    pytest.param(
        "qwen3", 6, dict(num_key_value_heads=4, tie_word_embeddings=True), id="qwen3-mha-tied-s6"
    ),
]

SCENARIOS = {
    # name: LLM keyword arguments
    "default": dict(max_num_batched_tokens=512, enable_prefix_caching=False),
    "chunked": dict(max_num_batched_tokens=7, block_size=4),
    "preempt": dict(num_blocks=31, block_size=4, max_num_batched_tokens=64, max_model_len=120),
    "prefix": dict(max_num_batched_tokens=64, block_size=8),
}


@pytest.mark.parametrize(("arch", "seed", "overrides"), MODELS)
def test_matches_hf_greedy(
    tmp_path: Path, arch: str, seed: int, overrides: dict[str, object]
) -> None:
    model_dir = make_tiny_model(tmp_path / arch, arch, seed=seed, **overrides)
    prompts, max_tokens = workload(seed)
    ref = hf_greedy(model_dir, prompts, max_tokens)
    for name, scenario in SCENARIOS.items():
        kwargs = {"max_model_len": 256, **scenario}
        llm = LLM(model_dir, **kwargs)  # type: ignore[arg-type]
        ours = run_ours(llm, prompts, max_tokens)
        diverged = assert_close(ours, ref)
        assert diverged <= 2, f"{name}: {diverged} of 16 sequences diverged within float noise"
        stats = llm.engine_stats()
        if name == "preempt":
            assert stats["num_preemptions"] > 0, stats
        if name == "prefix":
            # 7 later prompts share the first's 37-token prefix: 4 full blocks of 8 each.
            assert stats["prefix_cache_hits"] >= 7 * 32, stats
        if name == "chunked":
            assert stats["num_steps"] > sum(len(p) for p in prompts) // 7
        assert stats["kv_blocks_used"] == 0, stats
