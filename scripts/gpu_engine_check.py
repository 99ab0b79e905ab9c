"""GPU check of the engine with the Triton attention backend, eager and with decode CUDA graphs.

1. Greedy equality, fp32 on CUDA, tiny random Llama (GQA) and Qwen3 models: the triton backend
   (graphs, and --enforce-eager) against the torch backend through chunked prefill, prefix-cache
   hits, preemption and a decode-heavy batch that fills several graph buckets; then with two
   LoRA adapters mixed with base requests (the graphs' LoRA metadata refresh on the device).
   Sequences are compared as the engine tests do (tests/utils/reference.py: a difference must be
   within float noise, i.e. each token in the other's top-5); at most 2 of 20 may diverge.
2. bf16 parity with Hugging Face on CUDA: the first token's top-5 logprobs of the triton
   backend against HF bf16 (|difference| <= 0.1 nats); where the top-1 differs, HF's logprob of
   our token is within 0.1 of its best (a near tie, not an error).

    python scripts/gpu_engine_check.py OUT.json        (PYTHONPATH = the repository root)
    TRITON_INTERPRET=1 python scripts/gpu_engine_check.py OUT.json --cpu-smoke   (tiny, CPU)
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from loraplex import LoRARequest, SamplingParams
from loraplex.llm import LLM
from tests.utils.models import make_adapter, make_tiny_model
from tests.utils.reference import TOP, assert_close, traces

SMOKE = "--cpu-smoke" in sys.argv  # the same code, tiny, on the CPU (no graphs there)
DEVICE = "cpu" if SMOKE else "cuda"
SCENARIOS: dict[str, dict[str, Any]] = {
    "chunked": dict(max_num_batched_tokens=7, block_size=4, enable_prefix_caching=False),
    "prefix": dict(max_num_batched_tokens=64, block_size=8),
    "preempt": dict(num_blocks=31, block_size=4, max_num_batched_tokens=64, max_model_len=120),
    "decode-heavy": dict(max_num_seqs=24, max_num_batched_tokens=256, block_size=16),
}
BACKENDS: dict[str, dict[str, Any]] = {
    "triton+graphs": dict(attention_backend="triton"),
    "triton-eager": dict(attention_backend="triton", enforce_eager=True),
}


def workload(seed: int, n: int = 20) -> tuple[list[list[int]], list[int]]:
    n = 4 if SMOKE else n
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(37)]
    prompts = [
        (prefix if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 48))]
        for i in range(n)
    ]
    return prompts, [rng.randint(2, 4) if SMOKE else rng.randint(4, 32) for _ in range(n)]


def run(
    llm: LLM, prompts: list[list[int]], lens: list[int], loras: list[LoRARequest | None] | None
) -> list[Any]:
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP) for n in lens
    ]
    return traces(llm.generate(prompts, params, lora_request=loras, use_tqdm=False))


def graphs_captured(llm: LLM) -> list[int] | str:
    """The buckets captured, or why capture failed (the engine then decodes eagerly)."""
    graphs = llm.llm_engine.core.runner.graphs
    if graphs is not None and graphs.disabled is not None:
        return f"capture failed: {graphs.disabled}"
    return [] if graphs is None else list(graphs.captured)


def graphs_ok(backend: str, captured: list[int] | str) -> bool:
    """With graphs on, some bucket must have been captured (none on the CPU smoke run)."""
    return SMOKE or backend != "triton+graphs" or (isinstance(captured, list) and bool(captured))


def greedy_checks(tmp: Path) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    models = {
        "llama-gqa": make_tiny_model(tmp / "llama", "llama", seed=0, num_key_value_heads=2),
        "qwen3-gqa": make_tiny_model(tmp / "qwen3", "qwen3", seed=5, num_key_value_heads=2),
    }
    for seed, (model_name, model_dir) in enumerate(models.items()):
        prompts, lens = workload(seed)
        for scenario, knobs in list(SCENARIOS.items())[: 1 if SMOKE else None]:
            kwargs = {"dtype": "float32", "max_model_len": 256, **knobs}
            ref = run(LLM(model_dir, attention_backend="torch", **kwargs), prompts, lens, None)
            for backend, extra in BACKENDS.items():
                name = f"{model_name} {scenario} {backend}"
                try:
                    llm = LLM(model_dir, **kwargs, **extra)
                    ours = run(llm, prompts, lens, None)
                    diverged = assert_close(ours, ref)
                    exact = sum(a[0] == b[0] for a, b in zip(ours, ref, strict=True))
                    captured = graphs_captured(llm)
                    ok = diverged <= 2 and graphs_ok(backend, captured)
                    entry = {"exact": exact, "diverged": diverged, "graphs": captured}
                except Exception as exc:
                    traceback.print_exc()
                    ok, entry = False, {"error": repr(exc)}
                results.append({"case": name, "ok": ok, **entry})
                print(f"{'ok ' if ok else 'FAIL'} {name}: {entry}", flush=True)

    # LoRA: two adapters and base requests in the same decode batches
    model_dir = models["llama-gqa"]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = [
        LoRARequest(f"a{i}", make_adapter(model_dir, tmp / f"a{i}", 8, 16, targets, i))
        for i in range(2)
    ]
    prompts, lens = workload(7)
    loras = [None if i % 3 == 0 else adapters[i % 3 - 1] for i in range(len(prompts))]
    kwargs = {"dtype": "float32", "max_model_len": 256, "max_loras": 2, "max_lora_rank": 8}
    ref = run(LLM(model_dir, attention_backend="torch", **kwargs), prompts, lens, loras)
    for backend, extra in BACKENDS.items():
        name = f"llama-gqa lora {backend}"
        try:
            llm = LLM(model_dir, **kwargs, **extra)
            ours = run(llm, prompts, lens, loras)
            diverged = assert_close(ours, ref)
            captured = graphs_captured(llm)
            ok = diverged <= 2 and graphs_ok(backend, captured)
            entry = {"diverged": diverged, "graphs": captured}
        except Exception as exc:
            traceback.print_exc()
            ok, entry = False, {"error": repr(exc)}
        results.append({"case": name, "ok": ok, **entry})
        print(f"{'ok ' if ok else 'FAIL'} {name}: {entry}", flush=True)
    return results


def bf16_parity(tmp: Path) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    results: list[dict[str, Any]] = []
    for arch in ("llama", "qwen3"):
        name = f"bf16 parity with HF, {arch}"
        try:
            model_dir = make_tiny_model(tmp / f"bf16-{arch}", arch, seed=3, num_key_value_heads=2)
            prompts, _ = workload(11)
            llm = LLM(model_dir, dtype="bfloat16", attention_backend="triton", max_model_len=256)
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=TOP)
            outs = llm.generate(prompts, params, use_tqdm=False)
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(DEVICE)
            worst, worst_tie, agree = 0.0, 0.0, 0
            with torch.inference_mode():
                for prompt, out in zip(prompts, outs, strict=True):
                    logits = hf(input_ids=torch.tensor([prompt], device=DEVICE)).logits[0, -1]
                    ref = torch.log_softmax(logits.float(), -1)
                    ours = out.outputs[0].logprobs[0]  # token -> Logprob, top-5 and the sampled
                    for tok, lp in ours.items():
                        worst = max(worst, abs(lp.logprob - float(ref[tok])))
                    tok = out.outputs[0].token_ids[0]
                    agree += int(tok == int(ref.argmax()))
                    # a different top-1 must be a near tie in HF's own distribution
                    worst_tie = max(worst_tie, float(ref.max() - ref[tok]))
            ok = worst <= 0.1 and worst_tie <= 0.1
            entry = {
                "max_logprob_diff": round(worst, 4),
                "top1_agree": f"{agree}/{len(prompts)}",
                "max_top1_gap": round(worst_tie, 4),
            }
        except Exception as exc:
            traceback.print_exc()
            ok, entry = False, {"error": repr(exc)}
        results.append({"case": name, "ok": ok, **entry})
        print(f"{'ok ' if ok else 'FAIL'} {name}: {entry}", flush=True)
    return results


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results = greedy_checks(tmp) + bf16_parity(tmp)
    ok = all(r["ok"] for r in results)
    with open(sys.argv[1], "w") as f:
        json.dump({"ok": ok, "cases": results}, f, indent=2)
    print(f"engine check: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
