"""The adapters of the multi-LoRA benchmark: which request uses which, and their weights.

Assignment: request i uses adapter ``i % N`` (``roundrobin``, issue 15's workload), or draws
adapter k independently, uniformly or with probability proportional to ``(k + 1) ** -alpha`` (the
power-law popularity of the S-LoRA paper), from a seeded generator.

Weights: random rank-``r`` PEFT LoRA adapters on all seven projections of every decoder layer,
generated at bench time into a temporary directory (never committed); adapter k has rank
``ranks[k % len(ranks)]`` (mixed ranks side by side). ``B`` is not left near zero:
each module's update ``scaling * B @ A`` is scaled to a fixed fraction of its base weight's
Frobenius norm, so every adapter really changes the greedy outputs. Same seed, same adapters.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

AdapterDist = Literal["uniform", "powerlaw", "roundrobin"]
ADAPTER_DISTS: tuple[AdapterDist, ...] = ("uniform", "powerlaw", "roundrobin")
TARGET_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)  # fmt: skip
# ||scaling * B @ A||_F = DELTA_RELATIVE_NORM * ||W||_F for every adapted module.
DELTA_RELATIVE_NORM = 0.1


def adapter_name(k: int) -> str:
    return f"bench-lora-{k}"


def adapter_weights(num_adapters: int, dist: AdapterDist, alpha: float = 1.0) -> list[float]:
    """Popularity of adapters 0 .. N-1, normalized to sum 1."""
    if num_adapters < 1:
        raise ValueError(f"num_adapters must be at least 1; got {num_adapters}")
    if dist in ("uniform", "roundrobin"):
        raw = [1.0] * num_adapters
    elif dist == "powerlaw":
        if alpha < 0:
            raise ValueError(f"--powerlaw-alpha must be 0 or more; got {alpha}")
        raw = [(k + 1) ** -alpha for k in range(num_adapters)]
    else:
        raise ValueError(
            f"unknown adapter distribution {dist!r}; use uniform, powerlaw or roundrobin"
        )
    total = sum(raw)
    return [w / total for w in raw]


def assign_adapters(
    num_requests: int, num_adapters: int, dist: AdapterDist, *, alpha: float = 1.0, seed: int = 0
) -> list[int]:
    """Adapter index of each request: ``i % N`` (roundrobin), else drawn i.i.d. from
    ``adapter_weights``."""
    weights = adapter_weights(num_adapters, dist, alpha)
    if dist == "roundrobin":
        return [i % num_adapters for i in range(num_requests)]
    rng = random.Random(f"loraplex-bench-adapters:{seed}")  # independent of the workload's rng
    return rng.choices(range(num_adapters), weights=weights, k=num_requests)


def requests_per_adapter(assignment: Sequence[int], num_adapters: int) -> list[int]:
    counts = Counter(assignment)
    return [counts.get(k, 0) for k in range(num_adapters)]


def adapter_ranks(num_adapters: int, ranks: int | Sequence[int]) -> list[int]:
    """Rank of adapters 0 .. N-1: ``ranks`` cycled (one int: every adapter)."""
    cycle = [ranks] if isinstance(ranks, int) else list(ranks)
    if not cycle or any(r < 1 for r in cycle):
        raise ValueError(f"adapter ranks must be at least 1; got {cycle}")
    return [cycle[k % len(cycle)] for k in range(num_adapters)]


def make_random_adapters(
    model_dir: str,
    out_dir: Path,
    num_adapters: int,
    *,
    rank: int | Sequence[int] = 8,
    seed: int = 0,
    relative_norm: float = DELTA_RELATIVE_NORM,
) -> dict[str, str]:
    """Write ``num_adapters`` PEFT adapters under ``out_dir``; return name -> directory.

    ``rank``: one rank for all, or ranks cycled over the adapters. One ``PeftModel`` is built per
    distinct rank; each adapter refills its ``A``/``B`` from a generator seeded by ``(seed, k)``
    and is saved to its own directory.
    """
    ranks = adapter_ranks(num_adapters, rank)
    dirs: dict[str, str] = {}
    for r in dict.fromkeys(ranks):  # distinct ranks, first-seen order
        mine = [k for k in range(num_adapters) if ranks[k] == r]
        dirs.update(_write_adapters(model_dir, out_dir, mine, r, seed, relative_norm))
    return {adapter_name(k): dirs[adapter_name(k)] for k in range(num_adapters)}


def _write_adapters(
    model_dir: str, out_dir: Path, indices: list[int], rank: int, seed: int, relative_norm: float
) -> dict[str, str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_MODULES), init_lora_weights=False
    )
    model = get_peft_model(base, config)
    scaling = config.lora_alpha / rank
    layers: list[Any] = [
        m for m in model.modules() if "default" in getattr(m, "lora_A", {})
    ]  # PEFT LoRA layers
    if not layers:
        raise ValueError(f"no {'/'.join(TARGET_MODULES)} modules found in {model_dir}")
    dirs: dict[str, str] = {}
    with torch.no_grad():
        for k in indices:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + k)
            for layer in layers:
                a = layer.lora_A["default"].weight  # [r, in]
                b = layer.lora_B["default"].weight  # [out, r]
                a.copy_(torch.randn(a.shape, generator=gen) / a.shape[1] ** 0.5)
                b.copy_(torch.randn(b.shape, generator=gen))
                delta = scaling * (b @ a)  # [out, in]
                w_norm = layer.get_base_layer().weight.norm()
                b.mul_(relative_norm * w_norm / delta.norm().clamp_min(1e-12))
            path = out_dir / adapter_name(k)
            model.save_pretrained(str(path))
            dirs[adapter_name(k)] = str(path)
    return dirs
