"""Tensor parallelism: the rank's group and the Megatron-split layers (column, row, vocabulary).

Each rank holds a share of every large weight; activations between layers are full and the same
on every rank::

    qkv_proj      column-parallel by heads: the rank's q heads | its k heads | its v heads
    o_proj        row-parallel: the rank's input columns; partial outputs summed (all-reduce)
    gate_up_proj  column-parallel: the rank's gate rows | its up rows
    down_proj     row-parallel (all-reduce)
    embed_tokens  vocabulary-parallel: the rank's rows; ids outside them give 0, then all-reduce
    lm_head       vocabulary-parallel: the rank's logit columns, gathered to rank 0 to sample

A layer is built for one (rank, size) and loads only its share: ``load_shard`` narrows each
checkpoint tensor. ``shard_lora`` gives the rank's share of an adapter's A and B for the layer
(S-LoRA's split, Sheng et al. Fig. 4): column-parallel layers keep A whole (the shrink runs on the
full input, no communication) and take B's rows of their columns; row-parallel layers take A's
columns of their input rows and keep B whole. The row-parallel delta is then a partial sum like
the base output (``x_p A_p^T B^T`` summed over ranks is ``x A^T B^T``), so it is added before the
layer's one all-reduce: no extra collective, no all-gather per adapter. When there are fewer KV
heads than ranks, each KV head is replicated on ``size // num_kv_heads`` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.models.layers import Linear, PackedLinear
from loraplex.kernels import packed_gemm


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group. ``group`` is a ``torch.distributed``
    process group object (gloo or NCCL), used directly: no global default group, so an engine
    can be built and closed several times in one process. None when ``size`` is 1 (every
    collective is then a no-op)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    backend: str = "gloo"  # "nccl": collectives on CUDA tensors

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """``x [S, n]`` of every rank concatenated along dim 1 (rank order) on rank 0; the
        other ranks get their own ``x`` back (only rank 0 samples)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        self.group.gather([parts] if parts else [], [x], opts).wait()
        return torch.cat(parts, dim=1) if parts else x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (every rank gets it)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else None
        )
        t = torch.tensor([value], dtype=torch.int64, device=device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        self.group.allreduce([t], opts).wait()
        return int(t.item())


SINGLE = TPGroup()


def split(total: int, tp: TPGroup | int, what: str) -> int:
    """``total // size``, refusing sizes the ranks cannot share evenly."""
    size = tp if isinstance(tp, int) else tp.size
    if total % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's {what} ({total}); "
            "choose a tensor_parallel_size that divides it"
        )
    return total // size


def kv_heads_of(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(KV heads this rank holds, index of its first): an even share, or one replicated head
    when there are fewer KV heads than ranks."""
    if num_kv_heads >= tp.size:
        n = split(num_kv_heads, tp, "number of key/value heads")
        return n, tp.rank * n
    if tp.size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp.size} is neither a divisor nor a multiple of the model's "
            f"{num_kv_heads} key/value heads; choose one that is"
        )
    return 1, tp.rank * num_kv_heads // tp.size


def check_shardable(hf_config: Any, size: int) -> None:
    """``ValueError`` naming the dimension when ``size`` ranks cannot share the model (checked
    before any rank is started). The vocabulary never blocks: its shards are padded."""
    heads = int(hf_config.num_attention_heads)
    split(heads, size, "number of attention heads")
    split(int(hf_config.intermediate_size), size, "intermediate_size")
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if kv < size and size % kv:
        raise ValueError(
            f"tensor_parallel_size {size} is neither a divisor nor a multiple of the model's "
            f"{kv} key/value heads; choose one that is"
        )
    if kv >= size:
        split(kv, size, "number of key/value heads")


class ColumnParallelLinear(PackedLinear):
    """A (packed) projection holding rows ``starts[s] : starts[s] + sizes[s]`` of each
    checkpoint module ``s``: the rank's output columns. The output is the rank's share."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],  # rows the rank holds, per module
        shard_starts: dict[str, int],  # their first row in the module's checkpoint tensor
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(in_features, shard_sizes, bias, dtype, device)
        self.shard_starts = dict(shard_starts)

    def load_shard(self, param_name: str, shard: str, loaded: torch.Tensor) -> None:
        _, size = self.output_slices[shard]
        start = self.shard_starts[shard]
        if loaded.shape[0] < start + size:
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(loaded.shape)}, this rank needs rows "
                f"{start}..{start + size}"
            )
        super().load_shard(param_name, shard, loaded.narrow(0, start, size))

    def shard_lora(
        self, shard: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``[r, in]`` whole (the shrink is local), B ``[out, r]`` narrowed to the rank's rows."""
        _, size = self.output_slices[shard]
        return a, b.narrow(0, self.shard_starts[shard], size)


class RowParallelLinear(Linear):
    """``y = sum over ranks of x_p @ W_p.T (+ b)``: the rank holds input columns
    ``[rank * in, (rank + 1) * in)`` of the checkpoint's weight (``in`` = ``in_features``, the
    rank's share); ``x`` is the rank's share of the input (the column-parallel layer's output).
    The bias is added on rank 0 only, so the sum holds it once."""

    def __init__(
        self,
        in_features: int,  # the rank's share of the input width
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.tp = tp
        self.in_start = tp.rank * in_features

    def load_shard(self, param_name: str, shard: str, loaded: torch.Tensor) -> None:
        if param_name == "weight":
            end = self.in_start + self.in_features
            if loaded.dim() != 2 or loaded.shape[1] < end:
                raise ValueError(
                    f"shape mismatch: checkpoint has {tuple(loaded.shape)}, this rank needs "
                    f"columns {self.in_start}..{end}"
                )
            loaded = loaded.narrow(1, self.in_start, self.in_features)
        super().load_shard(param_name, shard, loaded)

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output ``[T, out]`` (bias on rank 0), before the all-reduce."""
        bias = self.bias if self.tp.rank == 0 else None
        return packed_gemm.linear(x, self.weight, self.packed, bias)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(y)

    def local_gemm(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return self.weight, self.packed, self.bias if self.tp.rank == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.forward_local(x))  # [T, out]

    def shard_lora(
        self, shard: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``[r, in]`` narrowed to the rank's input columns (a partial shrink), B whole."""
        return a.narrow(1, self.in_start, self.in_features), b


def vocab_shard(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(rows per rank, padded to an even share; this rank's first row; its real rows)."""
    per_rank = -(-vocab_size // tp.size)
    start = tp.rank * per_rank
    return per_rank, start, max(0, min(per_rank, vocab_size - start))


def load_vocab_rows(param: torch.Tensor, loaded: torch.Tensor, start: int, real: int) -> None:
    """Copy checkpoint rows ``start : start + real`` into ``param``; padding rows stay zero."""
    if loaded.dim() != 2 or loaded.shape[1] != param.shape[1]:
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects rows of "
            f"{param.shape[1]}"
        )
    param.data.zero_()
    param.data.narrow(0, 0, real).copy_(loaded.narrow(0, start, real))


class VocabParallelEmbedding(nn.Module):
    """Embedding rows ``[start, start + per_rank)`` of the vocabulary (padded); a lookup gives
    zeros for ids outside them and the all-reduce fills in the rank that holds each id.
    ``transposed``: stored ``[dim, rows]`` as ``models.llama.Embedding`` explains."""

    def __init__(
        self,
        num: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPGroup,
        transposed: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num
        self.rows, self.start, self.real = vocab_shard(num, tp)
        shape = (dim, self.rows) if transposed else (self.rows, dim)
        data = torch.zeros(shape, dtype=dtype, device=device)
        self.weight = nn.Parameter(data.t() if transposed else data, requires_grad=False)

    def load_weight(self, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
                f"{self.num_embeddings} rows"
            )
        load_vocab_rows(self.weight, loaded, self.start, self.real)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # [T]
        outside = (local < 0) | (local >= self.real)  # [T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, dim]
        out.masked_fill_(outside.unsqueeze(1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(Linear):
    """The LM head's rows ``[start, start + per_rank)`` (padded with zero rows): the rank's
    logit columns; ``ParallelLMHead.gather`` joins them on rank 0."""

    def __init__(
        self, dim: int, vocab_size: int, dtype: torch.dtype, device: torch.device, tp: TPGroup
    ) -> None:
        rows, start, real = vocab_shard(vocab_size, tp)
        super().__init__(dim, rows, False, dtype, device)
        self.vocab_size, self.start, self.real = vocab_size, start, real

    def load_shard(self, param_name: str, shard: str, loaded: torch.Tensor) -> None:
        if param_name != "weight" or loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
                f"{self.vocab_size} rows"
            )
        self.packed = None
        load_vocab_rows(self.weight, loaded, self.start, self.real)


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """Rank 0: the full logits ``[S, vocab_size]`` from every rank's ``[S, per_rank]`` (padding
    columns dropped); other ranks: their own share (unused)."""
    if tp.size == 1:
        return local
    full = tp.gather_columns(local)
    return full[:, :vocab_size] if tp.rank == 0 else full
