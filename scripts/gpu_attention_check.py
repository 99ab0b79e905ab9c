"""GPU check of the Triton paged-attention and KV-write kernels against their torch references.

Cases on CUDA: bf16 and fp16; head sizes 64/80/96/128/256; GQA 8:1, 2:1 and MHA; block sizes 16
and 32; a mixed batch (decodes up to 2k keys, a first prefill chunk, a chunk after a cached
prefix, a one-token sequence) and long-context decode batches with split-KV. Then times the
kernel (CUDA events, median of 20) on a Qwen3-0.6B-shaped decode batch (64 x 1024 keys, 16/8
heads of 128) against the torch backend's gather + SDPA, and reports the KV bandwidth reached.
Prints one line per case and writes JSON to argv[1]; exits 1 when a case fails.

    python scripts/gpu_attention_check.py OUT.json
    TRITON_INTERPRET=1 python scripts/gpu_attention_check.py OUT.json --cpu-smoke   (tiny, CPU)
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from loraplex.kernels.kv_write import write_kv, write_kv_torch
from loraplex.kernels.paged_attention import paged_attention, paged_attention_torch

SMOKE = "--cpu-smoke" in sys.argv  # the same code on tiny shapes in the interpreter
DEV = torch.device("cpu" if SMOKE else "cuda")
TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
HBM_BYTES_PER_S = 4.8e12  # H200; the report names the GPU actually used


class _Skip(Exception):
    """No timing in the CPU smoke run."""


def make_batch(
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> dict[str, Any]:
    """(cached prefix, query length) per request; K/V of every key already in a random cache."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    seq_lens = [s + n for s, n in seqs]
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks - 1, generator=g, device=DEV) + 1  # shuffled, never block 0
    width = max(need)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32, device=DEV)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g, device=DEV)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g, device=DEV)
    k_cache[0] = v_cache[0] = 0
    qlens = [n for _, n in seqs]
    qsl = torch.tensor([0] + [sum(qlens[: i + 1]) for i in range(len(qlens))], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, head_dim, generator=g, device=DEV)
    return dict(
        q=q.to(dtype),
        k_cache=k_cache.to(dtype),
        v_cache=v_cache.to(dtype),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        query_start_loc=qsl.to(DEV),
        max_query_len=max(qlens),
    )


def attend(fn: Callable[..., torch.Tensor], b: dict[str, Any], **kw: Any) -> torch.Tensor:
    out = torch.full_like(b["q"], float("nan"))
    return fn(
        b["q"], b["k_cache"], b["v_cache"], out, b["block_tables"], b["seq_lens"],
        b["query_start_loc"], max_query_len=b["max_query_len"], **kw,
    )  # fmt: skip


def reference(b: dict[str, Any]) -> torch.Tensor:
    """The torch reference in fp32 from the same (rounded) inputs."""
    f32 = {k: v.float() if k in ("q", "k_cache", "v_cache") else v for k, v in b.items()}
    return attend(paged_attention_torch, f32)


def timed(fn: Callable[[], object], reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def parity_cases() -> list[tuple[str, dict[str, Any], int]]:
    mixed = [(1500, 1), (0, 700), (37, 1), (0, 1), (500, 300), (2047, 1), (16, 16), (31, 1)]
    long_decode = [(8191, 1), (3000, 1), (100, 1), (5000, 1)]
    head_dims: tuple[int, ...] = (64, 80, 96, 128, 256)
    if SMOKE:
        mixed = [(15, 1), (0, 7), (37, 1), (0, 1), (5, 3), (20, 1), (16, 16), (31, 1)]
        long_decode = [(81, 1), (30, 1), (10, 1), (50, 1)]
        head_dims = (80,)
    cases: list[tuple[str, dict[str, Any], int]] = []
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in head_dims:
            for heads, kv in ((16, 2), (8, 8)):
                name = f"mixed {str(dtype)[6:]} D={head_dim} H={heads}/{kv}"
                cases.append((name, dict(seqs=mixed, heads=heads, kv=kv, d=head_dim, bs=16,
                                         dtype=dtype), 1))  # fmt: skip
        for segments in (4, 16):
            cases.append((f"split-KV x{segments} {str(dtype)[6:]}", dict(
                seqs=long_decode, heads=16, kv=8, d=128, bs=32, dtype=dtype), segments))  # fmt: skip
    return cases


def main() -> int:
    results: list[dict[str, Any]] = []
    ok = True
    for name, c, segments in parity_cases():
        try:
            b = make_batch(c["seqs"], c["heads"], c["kv"], c["d"], c["bs"], c["dtype"])
            got = attend(paged_attention, b, num_segments=segments).float()
            want = reference(b)
            err = (got - want).abs().max().item()
            atol, rtol = TOL[c["dtype"]]
            passed = bool(torch.allclose(got, want, atol=atol, rtol=rtol))
        except Exception:  # a crash is a failed case, reported with its traceback
            traceback.print_exc()
            err, passed = float("nan"), False
        ok &= passed
        results.append({"case": name, "max_abs_err": err, "ok": passed})
        print(f"{'ok ' if passed else 'FAIL'} {name}: max abs err {err:.2e}", flush=True)

    for dtype in (torch.bfloat16, torch.float16):
        name = f"kv write {str(dtype)[6:]}"
        try:
            k = torch.randn(300, 8, 128, device=DEV).to(dtype)
            v = torch.randn(300, 8, 128, device=DEV).to(dtype)
            slots = torch.randperm(64 * 16, device=DEV)[:300] + 16
            slots[::7] = -1  # pad rows
            ref = torch.zeros(2, 66, 16, 8, 128, device=DEV, dtype=dtype)
            ours = ref.clone()
            write_kv_torch(k, v, ref[0], ref[1], slots)
            write_kv(k, v, ours[0], ours[1], slots)
            passed = bool(torch.equal(ref, ours))
        except Exception:
            traceback.print_exc()
            passed = False
        ok &= passed
        results.append({"case": name, "ok": passed})
        print(f"{'ok ' if passed else 'FAIL'} {name}", flush=True)

    timings: dict[str, Any] = {}
    try:
        if SMOKE:
            raise _Skip
        # Qwen3-0.6B attention shape, decode: 64 requests x 1024 keys, block 16, bf16
        b = make_batch([(1023, 1)] * 64, 16, 8, 128, 16, torch.bfloat16, seed=1)
        out = torch.empty_like(b["q"])
        args = (b["q"], b["k_cache"], b["v_cache"], out, b["block_tables"], b["seq_lens"],
                b["query_start_loc"])  # fmt: skip
        triton_ms = timed(lambda: paged_attention(*args, max_query_len=1))
        split_ms = timed(lambda: paged_attention(*args, max_query_len=1, num_segments=4))
        # the torch backend's decode: gather the blocks padded to the longest, masked SDPA
        tables = b["block_tables"].long()

        def torch_decode() -> torch.Tensor:
            keys = b["k_cache"][tables].flatten(1, 2).transpose(1, 2)  # [B, H_kv, S, D]
            vals = b["v_cache"][tables].flatten(1, 2).transpose(1, 2)
            q = b["q"].view(64, 8, 2, 128)  # [B, H_kv, G, D]
            return torch.nn.functional.scaled_dot_product_attention(q, keys, vals)

        torch_ms = timed(torch_decode)
        kv_bytes = 64 * 1024 * 2 * 8 * 128 * 2  # one layer's K and V, bf16
        timings = {
            "shape": "decode 64 x 1024 keys, 16 q / 8 kv heads, D=128, block 16, bf16, one layer",
            "triton_ms": round(triton_ms, 4),
            "triton_split4_ms": round(split_ms, 4),
            "torch_gather_sdpa_ms": round(torch_ms, 4),
            "kv_bytes": kv_bytes,
            "triton_kv_tb_per_s": round(kv_bytes / (triton_ms * 1e-3) / 1e12, 3),
            "fraction_of_4_8_tb_per_s": round(kv_bytes / (triton_ms * 1e-3) / HBM_BYTES_PER_S, 3),
        }
        print(f"timing: {json.dumps(timings)}", flush=True)
    except _Skip:
        pass
    except Exception:
        traceback.print_exc()
        ok = False
    with open(sys.argv[1], "w") as f:
        json.dump({"ok": ok, "cases": results, "timing": timings}, f, indent=2)
    print(f"attention check: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
