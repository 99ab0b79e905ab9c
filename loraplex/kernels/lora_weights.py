"""One LoRA layer's view of the adapter pool: page rows per slice and the page index.

Adapter weights live in fixed-size pages of a pool (``loraplex.lora.pool``): one page is one
rank-row of one target module, A's row and B's row together, in every decoder layer. An adapter
of rank r takes exactly r pages of each module it targets, so adapters of rank 4 and 64 sit side
by side without padding. A step names its adapters by slot (``0 .. max_loras - 1``); the page
index says where each slot's rows are::

    pages[j, s, k]   pool row of rank-row k of slot s's adapter in slice j (k < ranks[j, s])
    ranks[j, s]      that adapter's rank in slice j; 0: the slot is empty or does not target j

    lora_a[j][pages[j, s, k]]   row k of A   (width in_features)
    lora_b[j][pages[j, s, k]]   row k of B^T (width n_j), PEFT scaling folded in

so ``y[t, off_j : off_j + n_j] += (x[t] @ A.T) @ B^T`` with ``A = lora_a[j][rows]``,
``B^T = lora_b[j][rows]`` and ``rows = pages[j, s, :ranks[j, s]]`` for each token t of slot s
(``add_lora_reference``, the per-token loop every kernel is tested against). Entries of ``pages``
at k >= rank are never read. ``pages`` and ``ranks`` are views of engine-wide tables shared by
every layer: a module's rows are the same in every layer.

Backends keep what they prepare from the weights in ``caches`` (by name); every write of a slot's
page index or of its rows must call ``invalidate(slot)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


class PreparedWeights(Protocol):
    """What a backend derives from the weights and must drop when a slot changes."""

    def invalidate(self, slot: int | None) -> None: ...


@dataclass(frozen=True)
class LoRALayerWeights:
    lora_a: tuple[torch.Tensor, ...]  # per slice j [num_pages_j, in_features]
    lora_b: tuple[torch.Tensor, ...]  # per slice j [num_pages_j, n_j]
    pages: torch.Tensor  # [num_slices, max_loras, max_rank] int32
    ranks: torch.Tensor  # [num_slices, max_loras] int32
    slice_offsets: tuple[int, ...]  # column offset of slice j in the layer's output
    caches: dict[str, PreparedWeights] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        S = len(self.lora_a)
        if not (S == len(self.lora_b) == len(self.slice_offsets) >= 1):
            raise ValueError(
                f"lora_a, lora_b and slice_offsets need one entry per slice, got "
                f"{len(self.lora_a)}, {len(self.lora_b)}, {len(self.slice_offsets)}"
            )
        a0 = self.lora_a[0]
        dtype, device = a0.dtype, a0.device
        for name, pools in (("lora_a", self.lora_a), ("lora_b", self.lora_b)):
            for j, p in enumerate(pools):
                if p.dim() != 2 or p.dtype != dtype or p.device != device:
                    raise ValueError(
                        f"{name}[{j}] must be a 2-D [num_pages, width] {dtype} tensor on "
                        f"{device}, got {p.dtype} {tuple(p.shape)} on {p.device}"
                    )
                if not p.is_contiguous():
                    raise ValueError(f"{name}[{j}] must be contiguous")
        for j, (a, b) in enumerate(zip(self.lora_a, self.lora_b, strict=True)):
            if a.shape[1] != a0.shape[1] or b.shape[0] != a.shape[0]:
                raise ValueError(
                    f"slice {j}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} need the "
                    f"same number of pages and in_features {a0.shape[1]}"
                )
        if self.pages.dtype != torch.int32 or self.pages.dim() != 3 or self.pages.shape[0] != S:
            raise ValueError(
                f"pages must be int32 [{S}, max_loras, max_rank], got {self.pages.dtype} "
                f"{tuple(self.pages.shape)}"
            )
        if self.ranks.dtype != torch.int32 or tuple(self.ranks.shape) != tuple(
            self.pages.shape[:2]
        ):
            raise ValueError(
                f"ranks must be int32 {tuple(self.pages.shape[:2])}, got {self.ranks.dtype} "
                f"{tuple(self.ranks.shape)}"
            )
        if self.pages.device != device or self.ranks.device != device:
            raise ValueError(f"pages and ranks must be on {device} like the pools")
        if min(self.slice_offsets) < 0:
            raise ValueError(f"slice offsets must not be negative, got {self.slice_offsets}")

    @property
    def num_slices(self) -> int:
        return len(self.lora_a)

    @property
    def max_loras(self) -> int:
        return int(self.pages.shape[1])

    @property
    def max_rank(self) -> int:
        return int(self.pages.shape[2])

    @property
    def in_features(self) -> int:
        return int(self.lora_a[0].shape[1])

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(int(b.shape[1]) for b in self.lora_b)

    @property
    def num_pages(self) -> tuple[int, ...]:
        return tuple(int(a.shape[0]) for a in self.lora_a)

    @property
    def dtype(self) -> torch.dtype:
        return self.lora_a[0].dtype

    @property
    def device(self) -> torch.device:
        return self.lora_a[0].device

    def tiles_columns(self, total_out: int) -> bool:
        """True when the slices cover columns ``[0, total_out)`` in order, without gaps."""
        end = 0
        for off, n in zip(self.slice_offsets, self.widths, strict=True):
            if off != end:
                return False
            end += n
        return end == total_out

    def invalidate(self, slot: int | None = None) -> None:
        """Drop what every backend prepared from ``slot`` (every slot when None)."""
        for cache in self.caches.values():
            cache.invalidate(slot)

    def slot_rows(self, j: int, slot: int) -> torch.Tensor:
        """Slot ``slot``'s pool rows in slice ``j``: ``[rank]`` int64 (empty when rank is 0)."""
        r = int(self.ranks[j, slot])
        return self.pages[j, slot, :r].to(torch.int64)


def check_page_index(weights: LoRALayerWeights) -> None:
    """Raise ``ValueError`` unless every page the index names (below each rank) is a row of its
    pool and no two live (slice, slot, rank-row) entries share a row. Not per step: the manager
    writes only rows it allocated; tests and debugging call this."""
    for j, pool_rows in enumerate(weights.num_pages):
        ranks = weights.ranks[j].tolist()
        seen: dict[int, int] = {}
        for s, r in enumerate(ranks):
            if r < 0 or r > weights.max_rank:
                raise ValueError(f"slice {j} slot {s}: rank {r} outside [0, {weights.max_rank}]")
            for p in weights.pages[j, s, :r].tolist():
                if not 0 <= p < pool_rows:
                    raise ValueError(f"slice {j} slot {s}: page {p} outside [0, {pool_rows})")
                if seen.setdefault(p, s) != s:
                    raise ValueError(f"slice {j}: page {p} is named by slots {seen[p]} and {s}")


def add_lora_reference(
    y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights, token_slots: Sequence[int]
) -> None:
    """The per-token loop every backend is tested against (fp32 accumulation)."""
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        for j, (off, n) in enumerate(zip(weights.slice_offsets, weights.widths, strict=True)):
            rows = weights.slot_rows(j, s)
            if rows.numel() == 0:
                continue
            a = weights.lora_a[j].index_select(0, rows).float()  # [r, in]
            b = weights.lora_b[j].index_select(0, rows).float()  # [r, n]
            delta = (x[t].float() @ a.T) @ b  # [n]
            y[t, off : off + n] += delta.to(y.dtype)
