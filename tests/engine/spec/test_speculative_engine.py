"""Speculative decoding end to end (``LLM`` on tiny random models, fp32, CPU): outputs with
speculation are those without it, token for token, for greedy and seeded requests, with both
proposers, with base and adapter requests in one batch, under chunked prefill, prefix caching,
preemption, ``n > 1``, stop strings, logprobs and structured outputs; unseeded sampling keeps
the target's distribution; the counters count."""

from __future__ import annotations

import collections
import random
from pathlib import Path
from typing import Any

import pytest

from loraplex import LoRARequest, SamplingParams, StructuredOutputsParams
from loraplex.llm import LLM
from tests.utils.models import make_adapter, make_tiny_model
from tests.utils.structured import byte_model, satisfies

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64}
# A small draft with the same vocabulary: 1 layer, half the width.
DRAFT_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
KNOBS = dict(num_blocks=400, block_size=4, max_num_batched_tokens=48, max_num_seqs=16)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("spec")
    out = {
        "llama": make_tiny_model(root / "llama", "llama", seed=3),
        "qwen3": make_tiny_model(root / "qwen3", "qwen3", seed=5),
        "draft": make_tiny_model(root / "draft", "llama", seed=7, **DRAFT_SHAPE),
    }
    for name in ("llama", "qwen3"):
        out[f"{name}-a"] = make_adapter(out[name], root / f"{name}-a", 4, 8,
                                        ["q_proj", "v_proj", "down_proj"], seed=1)  # fmt: skip
        out[f"{name}-b"] = make_adapter(out[name], root / f"{name}-b", 8, 16,
                                        ["o_proj", "gate_proj"], seed=2)  # fmt: skip
    return out


def workload(seed: int, n: int = 12) -> list[list[int]]:
    """Prompts that repeat a passage (prompt lookup has something to find), some sharing a
    prefix (prefix-cache hits), of 20 to 90 tokens (several prefill chunks)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(12)]
    prompts = []
    for i in range(n):
        passage = [rng.randrange(3, 500) for _ in range(rng.randint(6, 24))]
        tail = [rng.randrange(3, 500) for _ in range(rng.randint(1, 6))]
        prompts.append((shared if i % 3 == 0 else []) + passage + tail + passage[:3])
    return prompts


def outputs(llm: LLM, prompts: list[list[int]], params: Any, **kw: Any) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False, **kw)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def spec_config(method: str, models: dict[str, str]) -> dict[str, Any]:
    if method == "ngram":
        return NGRAM
    return {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}  # fmt: skip


def self_draft(model_dir: str, k: int = 3, batch: int = 64) -> dict[str, Any]:
    """The model as its own draft: its argmax is accepted with the probability the sampled
    distribution gives it, so sampled requests accept and reject often (a random model's
    sampled tokens rarely repeat, so prompt lookup finds little to verify there)."""
    return {"method": "draft_model", "model": model_dir, "num_speculative_tokens": k,
            "disable_by_batch_size": batch}  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_with_adapters_mixed_is_token_for_token(
    models: dict[str, str], arch: str, method: str
) -> None:
    prompts = workload(1)
    loras = [
        None
        if i % 3 == 0
        else LoRARequest(f"{arch}-{'ab'[i % 2]}", models[f"{arch}-{'ab'[i % 2]}"])
        for i in range(len(prompts))
    ]
    params = [SamplingParams(max_tokens=24 + i, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    plain = LLM(models[arch], **KNOBS, max_loras=2)
    want = outputs(plain, prompts, params, lora_request=loras)
    spec = LLM(models[arch], **KNOBS, max_loras=2, speculative_config=spec_config(method, models))
    assert outputs(spec, prompts, params, lora_request=loras) == want
    stats = spec.engine_stats().speculative
    assert stats is not None and stats.method == method
    assert stats.num_verifications > 0 and stats.num_draft_tokens > 0
    if method == "ngram":
        assert stats.num_accepted_tokens > 0
    assert stats.num_emitted_tokens >= stats.num_verifications + stats.num_accepted_tokens - 12
    assert spec.engine_stats().kv_blocks_used == 0


def test_the_model_as_its_own_draft_accepts_every_greedy_draft(models: dict[str, str]) -> None:
    """A draft model identical to the target agrees with every greedy token: a check of the
    draft KV (trims, chunked catch-up) as much as of the acceptance counting."""
    prompts = workload(2, n=6)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    spec = LLM(models["llama"], **KNOBS, speculative_config=self_draft(models["llama"]))
    got = outputs(spec, prompts, params)
    assert got == outputs(LLM(models["llama"], **KNOBS), prompts, params)
    stats = spec.engine_stats().speculative
    assert stats is not None and stats.num_draft_tokens > 50
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.accepted_per_position[0] == stats.num_verifications


def test_seeded_sampling_n_samples_and_preemption_match_without_speculation(
    models: dict[str, str],
) -> None:
    """A seeded request draws its noise per output position: speculating changes none of its
    tokens, for n > 1 samples too, while a small KV pool forces preemptions."""
    prompts = workload(3, n=8)
    params = [
        SamplingParams(n=2 if i % 2 else 1, max_tokens=28, temperature=0.8, seed=100 + i,
                       ignore_eos=True, repetition_penalty=1.1 if i % 3 == 0 else 1.0)
        for i in range(len(prompts))
    ]  # fmt: skip
    small = {**KNOBS, "num_blocks": 40}
    plain = LLM(models["llama"], **small)
    want = outputs(plain, prompts, params)
    spec = LLM(models["llama"], **small, speculative_config=self_draft(models["llama"]))
    assert outputs(spec, prompts, params) == want
    assert spec.engine_stats().num_preemptions > 0
    stats = spec.engine_stats().speculative
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_logprobs_stop_strings_and_stop_tokens(models: dict[str, str]) -> None:
    prompts = workload(4, n=6)
    plain = LLM(models["llama"], **KNOBS)
    spec = LLM(models["llama"], **KNOBS, speculative_config=NGRAM)
    lp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    a = plain.generate(prompts, lp, use_tqdm=False)
    b = spec.generate(prompts, lp, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        cx, cy = x.outputs[0], y.outputs[0]
        assert cx.token_ids == cy.token_ids
        assert cx.logprobs is not None and cy.logprobs is not None
        assert len(cy.logprobs) == len(cy.token_ids)
        for px, py in zip(cx.logprobs, cy.logprobs, strict=True):
            assert px.keys() == py.keys()
            for t in px:
                assert abs(px[t].logprob - py[t].logprob) < 1e-4
    # A stop string and a stop token in the middle of an accepted run end the output there.
    full = [o.outputs[0] for o in a]
    stops = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                       stop=[full[i].text.split()[5]] if i % 2 else None,
                       stop_token_ids=[full[i].token_ids[7]] if i % 2 == 0 else None)
        for i in range(len(prompts))
    ]  # fmt: skip
    want = [
        (o.outputs[0].text, o.outputs[0].finish_reason)
        for o in plain.generate(prompts, stops, use_tqdm=False)
    ]
    got = [
        (o.outputs[0].text, o.outputs[0].finish_reason)
        for o in spec.generate(prompts, stops, use_tqdm=False)
    ]
    assert got == want and all(reason == "stop" for _, reason in got)


def test_structured_requests_decode_alone_and_stay_valid(tmp_path: Path) -> None:
    model_dir = byte_model(tmp_path / "m", seed=3)
    constraints = [
        StructuredOutputsParams(regex=r"(ab|cd){1,3}-[0-9]{2,4}"),
        StructuredOutputsParams(choice=["red", "green", "blue"]),
    ]
    prompts = ["abab abab abab", "red red red", "a free neighbour, a free neighbour"]
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=c)
              for c in constraints] + [SamplingParams(max_tokens=30, temperature=0.0)]  # fmt: skip
    knobs = dict(num_blocks=256, max_num_seqs=8, max_model_len=256)
    want = LLM(model_dir, **knobs).generate(prompts, params, use_tqdm=False)
    spec = LLM(model_dir, **knobs, speculative_config=NGRAM)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for out, c in zip(got[:2], constraints, strict=True):
        assert satisfies(c, out.outputs[0].text)


def test_unseeded_sampling_keeps_the_target_distribution(models: dict[str, str]) -> None:
    """Many unseeded samples of one prompt (the engine's generator is seeded at start, so the
    test is deterministic): the tokens at each position are distributed alike with speculation
    and without. Two samples of N draws from one distribution over ~20 likely tokens differ by
    about 0.05 in total variation; a verifier that accepted drafts too often (or rejected them
    and resampled from the unmodified target) moves the mass of the draft token by about
    ``p(d) * (1 - p(d))``, 0.2 here, so the bound 0.1 separates them."""
    rng = random.Random(9)
    prompt = [rng.randrange(3, 500) for _ in range(12)]
    n, length = 2000, 4
    # a random model is nearly flat at temperature 1: at 0.1 its argmax (the draft) is accepted
    # a third of the time
    params = SamplingParams(n=n, max_tokens=length, temperature=0.1, ignore_eos=True)
    knobs = {**KNOBS, "max_num_seqs": 128, "max_num_batched_tokens": 512, "num_blocks": 1200}
    plain = LLM(models["llama"], **knobs)
    spec = LLM(
        models["llama"],
        **knobs,
        speculative_config={**self_draft(models["llama"], k=1, batch=128), "adaptive": False},
    )
    a = [list(c.token_ids) for c in plain.generate([prompt], params, use_tqdm=False)[0].outputs]
    b = [list(c.token_ids) for c in spec.generate([prompt], params, use_tqdm=False)[0].outputs]
    stats = spec.engine_stats().speculative
    assert stats is not None and 500 < stats.num_accepted_tokens < stats.num_draft_tokens - 500
    assert a != b  # different noise: a real comparison of two samples
    for pos in range(length):
        ca = collections.Counter(t[pos] for t in a)
        cb = collections.Counter(t[pos] for t in b)
        tv = 0.5 * sum(abs(ca[t] - cb[t]) / n for t in ca.keys() | cb.keys())
        assert tv < 0.1, (pos, tv)


def test_a_draft_model_with_another_vocabulary_is_refused(
    models: dict[str, str], tmp_path: Path
) -> None:
    other = make_tiny_model(
        tmp_path / "other", "llama", seed=1, **{**DRAFT_SHAPE, "vocab_size": 256}
    )
    config = {"method": "draft_model", "model": other, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the served model 512"):
        LLM(models["llama"], **KNOBS, speculative_config=config)
