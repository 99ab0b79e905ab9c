"""Decode step time at batch B x C context against the HBM-bandwidth bound.

Builds the ModelRunner on MODEL_DIR (bf16), puts B requests at position C - 1 with their KV
already in the cache (random values: the cost does not depend on them), and times the same
decode step (idempotent: it rewrites its own slots) with CUDA events, median of N:

* ``forward``: the model's forward pass only (the captured graph's replay, or the eager call);
* ``step``: ``ModelRunner.execute`` (inputs, forward, logits, sampling, tokens back to the host).

Bound = (weight bytes + KV bytes read per step) / HBM bandwidth; the fraction reached is
bound / measured. Configurations: triton + CUDA graphs, triton eager, torch eager.

    python scripts/gpu_decode_bench.py MODEL_DIR OUT.json [--batch 64 --context 1024 --hbm-tb-s 4.8]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback
from typing import Any

import torch

from loraplex.config import CacheConfig, ModelConfig, SchedulerConfig
from loraplex.engine.records import ScheduledRequest, SchedulerOutput
from loraplex.engine.runner import ModelRunner
from loraplex.sampling_params import SamplingParams

BLOCK = 16


def median_ms(fn: Any, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(
    model_dir: str, backend: str, eager: bool, batch: int, context: int, reps: int
) -> dict[str, Any]:
    per_seq = -(-context // BLOCK)
    runner = ModelRunner(
        ModelConfig(model=model_dir, dtype="bfloat16", max_model_len=context + BLOCK,
                    attention_backend=backend, enforce_eager=eager),  # type: ignore[arg-type]
        CacheConfig(block_size=BLOCK, num_blocks=batch * per_seq + 1),
        SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(batch, 512)),
        model_dir,
    )  # fmt: skip
    runner.init_kv_cache()
    assert runner.kv_cache is not None
    runner.kv_cache.normal_()
    runner.kv_cache[:, :, 0].zero_()  # the null block
    params = SamplingParams(temperature=0.0, max_tokens=8)
    reqs = [
        ScheduledRequest(f"r{i}", [5 + i], context - 1, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)),
                         True, params, [5], [])
        for i in range(batch)
    ]  # fmt: skip
    out = SchedulerOutput(reqs)
    runner.execute(out)  # first step: Triton compiles, the graph of this bucket is captured
    step_ms = median_ms(lambda: runner.execute(out), reps)
    if runner.graphs is not None and runner.graphs.captured:
        replay = runner.graphs._graphs[runner.graphs.captured[-1]]  # the bucket just used
        forward_ms = median_ms(replay, reps)
    else:
        ids, pos, layout = runner._layout(reqs)
        md = runner.attn.build_metadata(layout)
        with torch.inference_mode():
            forward_ms = median_ms(lambda: runner.model(ids, pos, md), reps)
    spec = runner.spec
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_bytes = batch * context * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2
    result = {
        "backend": backend,
        "graphs": []
        if runner.graphs is None
        else runner.graphs.disabled or list(runner.graphs.captured),
        "forward_ms": round(forward_ms, 4),
        "step_ms": round(step_ms, 4),
        "weight_bytes": weight_bytes,
        "kv_bytes_per_step": kv_bytes,
        "tokens_per_s": round(batch / (step_ms * 1e-3), 1),
    }
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--hbm-tb-s", type=float, default=4.8, help="the GPU's HBM bandwidth (H200: 4.8)"
    )
    args = p.parse_args()
    runs: list[dict[str, Any]] = []
    ok = True
    for name, backend, eager in (("triton+graphs", "triton", False), ("triton-eager", "triton", True),
                                 ("torch-eager", "torch", True)):  # fmt: skip
        try:
            r = measure(args.model_dir, backend, eager, args.batch, args.context, args.reps)
        except Exception as exc:
            traceback.print_exc()
            ok = False
            r = {"error": repr(exc)}
        gc.collect()  # the runner, its graphs and their pool
        torch.cuda.empty_cache()
        r["config"] = name
        if "forward_ms" in r:
            bound_ms = (r["weight_bytes"] + r["kv_bytes_per_step"]) / (args.hbm_tb_s * 1e12) * 1e3
            r["bound_ms"] = round(bound_ms, 4)
            r["fraction_of_bound_forward"] = round(bound_ms / r["forward_ms"], 3)
            r["fraction_of_bound_step"] = round(bound_ms / r["step_ms"], 3)
        runs.append(r)
        print(json.dumps(r), flush=True)
    result = {"batch": args.batch, "context": args.context, "hbm_tb_s": args.hbm_tb_s, "runs": runs,
              "target": "fraction_of_bound_step >= 0.6 for triton+graphs (issue 18)"}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
