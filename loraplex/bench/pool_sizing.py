"""How large the benchmark's adapter pool is: bytes per value and ``lora_memory`` for N adapters."""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.bench.common import ThroughputOptions
from loraplex.config import DType


def value_bytes(dtype: DType) -> int:
    """Bytes per weight value of the engine's pool (its storage dtype; ``auto``: float32
    on CPU, bfloat16 on CUDA)."""
    if dtype == "auto":
        import torch

        return 2 if torch.cuda.is_available() else 4
    return 4 if dtype == "float32" else 2


def pool_plan(opts: ThroughputOptions, n: int, sizes: Sequence[int]) -> tuple[int | float, int]:
    """The engine's ``lora_memory`` for N adapters and how many of adapters 0 .. N-1 it holds
    (an estimate for a fraction of the KV cache: N)."""
    if opts.lora_memory is not None:
        if isinstance(opts.lora_memory, float):
            return opts.lora_memory, n
        budget, holds = opts.lora_memory, 0
        while holds < n and sum(sizes[: holds + 1]) <= budget:
            holds += 1
        return budget, holds
    k = opts.pool_adapters or n
    return sum(sizes[:k]), min(k, n)
