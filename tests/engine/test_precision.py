"""Precision by CPU (``engine/models/precision.py``): what ``dtype="auto"`` picks for each CPU,
and the bf16 path's accuracy against Hugging Face's bf16 with vLLM's tolerance rule for bf16
(greedy tokens equal until the first position where the reference's top two are nearly tied)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loraplex import SamplingParams
from loraplex.engine.default_model import resolve_model_dir
from loraplex.engine.models.precision import (
    AUTO_ENV,
    cpu_bf16_flags,
    resolve_precision,
    with_kv_cache,
)
from loraplex.kernels import packed_gemm
from loraplex.llm import LLM

CPU = torch.device("cpu")
F32, BF16 = torch.float32, torch.bfloat16


def test_auto_picks_bf16_matrix_products_only_on_cpus_with_bf16_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(AUTO_ENV, raising=False)
    zen4 = resolve_precision("auto", CPU, bf16_flags=("avx512_bf16",), bf16_kernel=True)
    assert (zen4.dtype, zen4.gemm_dtype, zen4.name) == (F32, BF16, "bfloat16")
    assert "AVX512_BF16" in zen4.reason
    spr = resolve_precision("auto", CPU, bf16_flags=("amx_bf16", "avx512_bf16"), bf16_kernel=True)
    assert spr.gemm_dtype == BF16 and "AMX_BF16" in spr.reason
    zen2 = resolve_precision("auto", CPU, bf16_flags=(), bf16_kernel=False)
    assert (zen2.dtype, zen2.gemm_dtype, zen2.name) == (F32, F32, "float32")
    assert "no bf16 units" in zen2.reason
    no_cc = resolve_precision("auto", CPU, bf16_flags=("avx512_bf16",), bf16_kernel=False)
    assert no_cc.name == "float32" and "not built" in no_cc.reason
    gpu = resolve_precision("auto", torch.device("cuda"), bf16_flags=(), bf16_kernel=False)
    assert gpu.dtype == gpu.gemm_dtype == BF16


def test_an_explicit_dtype_wins_and_the_override_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(AUTO_ENV, raising=False)
    f32 = resolve_precision("float32", CPU, bf16_flags=("avx512_bf16",), bf16_kernel=True)
    assert f32.dtype == f32.gemm_dtype == F32
    # without the native bf16 kernel, bfloat16 is a torch bf16 model (slow; auto never picks it)
    torch_bf16 = resolve_precision("bfloat16", CPU, bf16_flags=(), bf16_kernel=False)
    assert torch_bf16.dtype == torch_bf16.gemm_dtype == BF16
    monkeypatch.setenv(AUTO_ENV, "float32")
    pinned = resolve_precision("auto", CPU, bf16_flags=("avx512_bf16",), bf16_kernel=True)
    assert pinned.name == "float32" and AUTO_ENV in pinned.reason
    monkeypatch.setenv(AUTO_ENV, "fp8")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        resolve_precision("auto", CPU, bf16_flags=(), bf16_kernel=False)
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_precision("int8", CPU)


def test_cpu_flags_are_read_from_cpuinfo() -> None:
    info = "processor: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n"
    assert cpu_bf16_flags(info) == ("avx512_bf16",)
    assert cpu_bf16_flags("flags: fpu sse2\n") == ()


bf16_machine = pytest.mark.skipif(
    not packed_gemm.bf16_supported(),
    reason="this CPU has no AVX512-BF16 (or no C compiler): the bf16 path is not built here",
)

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about autumn leaves.",
    "Explain what a prime number is.",
]
MAX_TOKENS = 24
TIE_MARGIN = 0.25  # nats between the reference's top two: a tie bf16 rounding may break


def _chat_prompts() -> tuple[str, list[str]]:
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    return model_dir, prompts


def _assert_within_tie_rule(
    model_dir: str, prompts: list[str], outs: list[Any], dtype: torch.dtype
) -> None:
    """Greedy tokens equal to Hugging Face's in ``dtype`` until the first position where the
    reference's top two are within ``TIE_MARGIN`` (there ours must be one of those two); at
    least half the prompts exactly equal."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    exact = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        ours = list(out.outputs[0].token_ids)
        with torch.inference_mode():
            gen = hf.generate(
                ids, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        ref = gen.sequences[0, ids.shape[1] :].tolist()
        ref = ref[: len(gen.scores)]  # both stop at EOS (kept) or MAX_TOKENS
        if ours == ref:
            exact += 1
            continue
        # the first position where they differ (one may have ended with EOS there)
        i = next(
            (j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b),
            min(len(ours), len(ref)),
        )
        assert i < len(gen.scores), f"{prompt!r}: the reference ended at {i}, ours went on"
        top2 = torch.log_softmax(gen.scores[i][0].float(), -1).topk(2)
        gap = float(top2.values[0] - top2.values[1])
        assert gap < TIE_MARGIN and ours[i] in top2.indices.tolist(), (
            f"{prompt!r}: diverged at token {i} where the reference's top two are {gap:.3f} "
            f"nats apart (ours {ours[i]}, reference {ref[i]})"
        )
    assert exact >= len(QUESTIONS) // 2
    assert "Paris" in outs[0].outputs[0].text


@bf16_machine
@pytest.mark.slow
def test_bf16_greedy_text_matches_hugging_face_bf16_within_the_tie_rule() -> None:
    model_dir, prompts = _chat_prompts()
    llm = LLM(None, dtype="bfloat16")
    assert llm.llm_engine.core.runner.precision.gemm_dtype == BF16
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _assert_within_tie_rule(model_dir, prompts, outs, torch.bfloat16)


@pytest.mark.slow
def test_a_bf16_kv_cache_matches_hugging_face_fp32_within_the_tie_rule() -> None:
    """fp32 weights and activations, keys and values stored as bf16 (any CPU: widening bf16
    is a shift): the greedy text stays Hugging Face fp32's up to near-ties."""
    model_dir, prompts = _chat_prompts()
    llm = LLM(None, dtype="float32", kv_cache_dtype="bfloat16")
    runner = llm.llm_engine.core.runner
    assert runner.precision.cache_dtype == BF16 and runner.kv_cache is not None
    assert runner.kv_cache.dtype == BF16
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _assert_within_tie_rule(model_dir, prompts, outs, torch.float32)


def test_kv_cache_dtype_is_checked_and_gpus_keep_the_activations_dtype() -> None:
    fp32 = resolve_precision("float32", torch.device("cpu"))
    assert with_kv_cache(fp32, "auto", torch.device("cpu")) is fp32
    assert with_kv_cache(fp32, "bfloat16", torch.device("cpu")).cache_dtype == BF16
    assert with_kv_cache(fp32, "float32", torch.device("cpu")).kv_dtype is None
    gpu = resolve_precision("float16", torch.device("cuda"))
    with pytest.raises(ValueError, match="only the CPU stores the KV cache"):
        with_kv_cache(gpu, "bfloat16", torch.device("cuda"))
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        with_kv_cache(fp32, "float8", torch.device("cpu"))
