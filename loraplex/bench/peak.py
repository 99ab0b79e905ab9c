"""The machine's fp32 matmul peak, measured in the same run as the benchmark it normalizes."""

from __future__ import annotations

import time


def measure_fp32_peak_gflops(size: int = 2048, trials: int = 7) -> float:
    """Best-of-``trials`` GFLOP/s of ``torch.mm`` on ``size``×``size`` fp32 matrices."""
    import torch

    a = torch.randn(size, size, dtype=torch.float32)
    b = torch.randn(size, size, dtype=torch.float32)
    out = torch.empty(size, size, dtype=torch.float32)
    torch.mm(a, b, out=out)  # warm-up: thread pool, allocator
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9
