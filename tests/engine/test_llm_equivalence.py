"""loraplex against Hugging Face transformers, greedy, fp32, token for token.

The comparison (tests/utils/reference.py) is vLLM's: where the tokens differ, each side's token must be
in the other's top-5 logprobs (float noise), and the sequences are compared up to there. With these
tiny random models that almost never triggers; each scenario allows at most 2 of 16.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loraplex import SamplingParams
from loraplex.llm import LLM
from tests.utils.models import make_tiny_model
from tests.utils.reference import TOP, assert_close, hf_greedy, traces


def run_ours(
    llm: LLM, prompts: list[list[int]], max_tokens: list[int]
) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP)
        for n in max_tokens
    ]
    return traces(llm.generate(prompts, params, use_tqdm=False))


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
        kwargs = {"max_model_len": 256, "dtype": "float32", **scenario}
        llm = LLM(model_dir, **kwargs)  # type: ignore[arg-type]
        ours = run_ours(llm, prompts, max_tokens)
        diverged = assert_close(ours, ref)
        assert diverged <= 2, f"{name}: {diverged} of 16 sequences diverged within float noise"
        stats = llm.engine_stats()
        if name == "preempt":
            assert stats.num_preemptions > 0, stats
        if name == "prefix":
            # 7 later prompts share the first's 37-token prefix: 4 full blocks of 8 each.
            assert stats.prefix_cache_hits >= 7 * 32, stats
        if name == "chunked":
            assert stats.num_steps > sum(len(p) for p in prompts) // 7
        assert stats.kv_blocks_used == 0, stats
