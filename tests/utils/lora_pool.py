"""Pooled LoRA layer weights for kernel tests, laid out to expose a wrong page read.

Every slot's rank-rows are scattered over the pool in a random order (not contiguous, not
ascending, slices independent), and every row no live page names holds large random values, as
do the page entries past each rank (they name such garbage rows). A kernel that reads a row
through the wrong index, or past a rank, adds ~1e3 to the output instead of ~1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.kernels.lora_weights import LoRALayerWeights, add_lora_reference
from loraplex.kernels.meta import LoRAKernelMeta

GARBAGE = 1e3  # scale of the values in rows no live page names


@dataclass
class PooledLoRA:
    weights: LoRALayerWeights
    # The true matrices, per slice per slot (fp32 copies of the pool rows, empty at rank 0):
    a: list[list[torch.Tensor]]  # [slice][slot] [r, in]
    b: list[list[torch.Tensor]]  # [slice][slot] [r, n_j] (B^T rows)


def per_slice_ranks(ranks: Sequence[int] | Sequence[Sequence[int]], S: int) -> list[list[int]]:
    """``[r_slot, ...]`` (the same in every slice) or ``[[r_slot, ...] per slice]``."""
    if all(isinstance(r, int) for r in ranks):
        return [[int(r) for r in ranks] for _ in range(S)]  # type: ignore[arg-type]
    rows = [list(r) for r in ranks]  # type: ignore[arg-type]
    if len(rows) != S or len({len(r) for r in rows}) != 1:
        raise ValueError(f"need {S} equally long rank lists, got {ranks}")
    return rows


def make_pooled_weights(
    ranks: Sequence[int] | Sequence[Sequence[int]],
    in_features: int,
    widths: Sequence[int],
    dtype: torch.dtype = torch.float32,
    *,
    gen: torch.Generator,
    max_rank: int | None = None,
    offsets: Sequence[int] | None = None,
) -> PooledLoRA:
    S = len(widths)
    table = per_slice_ranks(ranks, S)  # [S][L]
    L = len(table[0])
    R = max_rank if max_rank is not None else max(1, *(max(r) for r in table))
    pages = torch.empty(S, L, R, dtype=torch.int32)
    pools_a, pools_b, dense_a, dense_b = [], [], [], []
    for j, n in enumerate(widths):
        live = sum(table[j])
        rows = 2 * live + 5  # as many garbage rows as live ones, and some
        pool_a = GARBAGE * torch.randn(rows, in_features, generator=gen)  # [P, in]
        pool_b = GARBAGE * torch.randn(rows, n, generator=gen)  # [P, n]
        order = torch.randperm(rows, generator=gen)  # live rows: order[:live], shuffled
        spare = order[live:]
        used = 0
        slot_a, slot_b = [], []
        for s, r in enumerate(table[j]):
            idx = order[used : used + r]
            used += r
            a = torch.randn(r, in_features, generator=gen) / in_features**0.5  # [r, in]
            b = torch.randn(r, n, generator=gen) / max(r, 1) ** 0.5  # [r, n]
            pool_a[idx] = a
            pool_b[idx] = b
            fill = spare[torch.randint(len(spare), (R - r,), generator=gen)]  # garbage rows
            pages[j, s] = torch.cat([idx, fill]).to(torch.int32)
            slot_a.append(a.to(dtype).float())
            slot_b.append(b.to(dtype).float())
        pools_a.append(pool_a.to(dtype))
        pools_b.append(pool_b.to(dtype))
        dense_a.append(slot_a)
        dense_b.append(slot_b)
    offs = tuple(offsets) if offsets is not None else tuple(sum(widths[:j]) for j in range(S))
    weights = LoRALayerWeights(
        tuple(pools_a), tuple(pools_b), pages, torch.tensor(table, dtype=torch.int32), offs
    )
    return PooledLoRA(weights, dense_a, dense_b)


@dataclass
class Case:
    x: torch.Tensor  # [T, in]
    y0: torch.Tensor  # [T, total_out]
    slots: list[int]  # [T] slot per token, -1 = base model
    pool: PooledLoRA
    meta: LoRAKernelMeta

    @property
    def weights(self) -> LoRALayerWeights:
        return self.pool.weights


def make_case(
    slots: Sequence[int],
    ranks: Sequence[int] | Sequence[Sequence[int]],
    in_features: int,
    widths: Sequence[int],
    dtype: torch.dtype = torch.float32,
    *,
    max_rank: int | None = None,
    max_num_tokens: int | None = None,
    offsets: Sequence[int] | None = None,
    out_features: int | None = None,
    seed: int = 0,
    activations: torch.dtype | None = None,
) -> Case:
    """``dtype``: the pools' (and, unless ``activations`` says otherwise, x's and y0's)."""
    gen = torch.Generator().manual_seed(seed)
    act = activations or dtype
    pool = make_pooled_weights(
        ranks, in_features, widths, dtype, gen=gen, max_rank=max_rank, offsets=offsets
    )
    T = len(slots)
    x = torch.randn(T, in_features, generator=gen).to(act)  # [T, in]
    y0 = torch.randn(T, out_features or sum(widths), generator=gen).to(act)  # [T, out]
    meta = LoRAKernelMeta(max_num_tokens or max(T, 1), pool.weights.max_loras)
    meta.prepare(torch.tensor(list(slots), dtype=torch.int64))
    return Case(x, y0, list(slots), pool, meta)


def reference(case: Case) -> torch.Tensor:
    """``add_lora_reference`` on a copy of y0 in fp32: ``[T, out]``."""
    y = case.y0.float().clone()  # [T, out]
    add_lora_reference(y, case.x, case.weights, case.slots)
    return y


def dense_reference(case: Case) -> torch.Tensor:
    """The same from the true per-slot matrices, no page index involved: ``[T, out]``."""
    w = case.weights
    y = case.y0.float().clone()  # [T, out]
    for t, s in enumerate(case.slots):
        if s < 0:
            continue
        for j, (off, n) in enumerate(zip(w.slice_offsets, w.widths, strict=True)):
            a, b = case.pool.a[j][s], case.pool.b[j][s]  # [r, in], [r, n]
            y[t, off : off + n] += (case.x[t].float() @ a.T) @ b
    return y


def dense_shrink(case: Case) -> torch.Tensor:
    """What the shrink writes into a zeroed buffer: ``[num_slices, T, max_rank]`` fp32."""
    w = case.weights
    out = torch.zeros(w.num_slices, len(case.slots), w.max_rank)  # [S, T, R]
    for t, s in enumerate(case.slots):
        if s < 0:
            continue
        for j in range(w.num_slices):
            a = case.pool.a[j][s]  # [r, in]
            out[j, t, : a.shape[0]] = case.x[t].float() @ a.T
    return out
