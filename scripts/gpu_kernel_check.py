"""GPU kernel check: Triton LoRA shrink/expand against the torch path on CUDA.

Cases: bf16 and fp16; ranks 8-64 mixed within a call; packed qkv-like slices; up to 4096 tokens
and 64 adapters; tokens with slot -1. Prints one line per case and writes JSON to argv[1].
Also times both paths (CUDA events, median of 20) for the largest shapes.
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial

import torch

from loraplex.kernels import LoRAKernelMeta, LoRALayerWeights, add_lora

TOL = {torch.float16: (2e-2, 1e-2), torch.bfloat16: (1e-1, 2e-2)}


def make_case(
    num_tokens: int,
    max_loras: int,
    ranks: list[int],
    hidden: int,
    outs: list[int],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, LoRALayerWeights, LoRAKernelMeta]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    max_rank = max(ranks)
    rank_t = torch.tensor(
        [ranks[s % len(ranks)] for s in range(max_loras)], dtype=torch.int32, device=dev
    )
    a = []
    b = []
    for n in outs:
        a_j = (
            torch.randn(max_loras, max_rank, hidden, generator=g, device=dev, dtype=torch.float32)
            * 0.05
        )
        b_j = (
            torch.randn(max_loras, max_rank, n, generator=g, device=dev, dtype=torch.float32) * 0.05
        )
        for s in range(max_loras):
            a_j[s, int(rank_t[s]) :] = 0
            b_j[s, int(rank_t[s]) :] = 0
        a.append(a_j.to(dtype))
        b.append(b_j.to(dtype))
    offsets = [sum(outs[:j]) for j in range(len(outs))]
    scales = torch.rand(max_loras, generator=g, device=dev) + 0.5
    weights = LoRALayerWeights(tuple(a), tuple(b), tuple(offsets), rank_t, scales.float())
    slots = torch.randint(-1, max_loras, (num_tokens,), generator=g, device=dev)
    meta = LoRAKernelMeta(num_tokens, max_loras, dev)
    meta.prepare(slots)
    x = (torch.randn(num_tokens, hidden, generator=g, device=dev) * 0.5).to(dtype)
    return x, weights, meta


def timed(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        fn()
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    results = []
    ok = True
    cases = [
        (64, 4, [8], 576, [576, 192, 192]),
        (512, 8, [8, 16], 2048, [2048, 512, 512]),
        (4096, 64, [8, 16, 32, 64], 4096, [4096, 1024, 1024]),
        (4096, 64, [64], 4096, [14336, 14336]),
        (1, 8, [16], 4096, [4096]),
    ]
    for dtype in (torch.bfloat16, torch.float16):
        for t, loras, ranks, hidden, outs in cases:
            x, w, meta = make_case(t, loras, ranks, hidden, outs, dtype)
            y0 = torch.zeros(t, sum(outs), device="cuda", dtype=dtype)
            y_triton, y_torch = y0.clone(), y0.clone()
            add_lora(y_triton, x, w, meta, backend="triton")
            add_lora(y_torch, x, w, meta, backend="torch")
            torch.cuda.synchronize()
            atol, rtol = TOL[dtype]
            err = (y_triton.float() - y_torch.float()).abs().max().item()
            good = torch.allclose(y_triton.float(), y_torch.float(), atol=atol, rtol=rtol)
            ok &= good
            entry = dict(
                dtype=str(dtype),
                tokens=t,
                max_loras=loras,
                ranks=ranks,
                hidden=hidden,
                outs=outs,
                max_abs_err=err,
                ok=good,
            )
            if t >= 512:
                entry["triton_ms"] = timed(
                    partial(add_lora, y_triton, x, w, meta, backend="triton")
                )
                entry["torch_ms"] = timed(partial(add_lora, y_torch, x, w, meta, backend="torch"))
            results.append(entry)
            print(json.dumps(entry), flush=True)
    out = {
        "gpu": torch.cuda.get_device_name(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "all_ok": ok,
        "cases": results,
    }
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
    print("ALL OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
