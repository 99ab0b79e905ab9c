"""S-LoRA's sharded LoRA (tensor parallelism) against the unsharded layer, on random tensors.

Ranks are simulated in one process: each rank's layer is built for its (rank, size), loads its
share of the same checkpoint tensors and its share of the same adapters (``shard_lora``, the
path the adapter manager fills the pool by), and runs ``LoRALinear.forward`` on its share of the
input. The cross-rank sum is an identity group here, so each rank's output is its partial;
the test sums (row-parallel) or concatenates (column-parallel) them and compares with one
unsharded ``LoRALinear`` over mixed base and adapter tokens of different ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loraplex.engine.models.layers import Linear, PackedLinear
from loraplex.engine.models.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    gather_logits,
)
from loraplex.kernels.lora_weights import LoRALayerWeights
from loraplex.kernels.meta import LoRAKernelMeta
from loraplex.lora.layers import LoRALinear, LoRAStep

CPU = torch.device("cpu")
F32 = torch.float32
MAX_LORAS, MAX_RANK, PAGES = 3, 8, 32
# slot -> rank per slice (0: the adapter does not target that module)
RANKS = {0: [4, 0, 8], 1: [8, 2, 1], 2: [1, 1, 1]}
TOKEN_SLOTS = [-1, 0, 0, 1, -1, 2, 1, 1, 0, -1, 2]  # base and three adapters, mixed


class _Done:
    def wait(self) -> None:
        return None


class LocalGroup:
    """A process group whose all-reduce keeps the rank's partial and records what it was
    given (the test sums those: whatever a layer adds after its reduce is not in them)."""

    def __init__(self) -> None:
        self.reduced: list[torch.Tensor] = []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        self.reduced.extend(t.clone() for t in tensors)
        return _Done()


def rank_group(rank: int, size: int) -> TPGroup:
    return TPGroup(rank, size, LocalGroup())


def lora_of(
    layer: Any, widths: list[int], adapters: dict[int, list[tuple[Any, Any]]]
) -> LoRALinear:
    """Wrap ``layer`` and fill a pool with its share of ``adapters`` (slot -> per slice
    (A [r, in_full], B [n_full, r]) or (None, None)), slot s at pages ``s * MAX_RANK ...``."""
    names = list(layer.output_slices)
    lora = LoRALinear(layer, names, LoRAStep())
    S = len(names)
    pages = torch.zeros(S, MAX_LORAS, MAX_RANK, dtype=torch.int32)
    ranks = torch.zeros(S, MAX_LORAS, dtype=torch.int32)
    lora.bind(
        LoRALayerWeights(
            lora_a=tuple(torch.zeros(PAGES, layer.in_features) for _ in range(S)),
            lora_b=tuple(torch.zeros(PAGES, n) for n in widths),
            pages=pages,
            ranks=ranks,
            slice_offsets=tuple(off for off, _ in layer.output_slices.values()),
        )
    )
    for slot, per_slice in adapters.items():
        for j, (a, b) in enumerate(per_slice):
            rows = torch.arange(slot * MAX_RANK, (slot + 1) * MAX_RANK)
            if a is not None:
                a, b = layer.shard_lora(names[j], a, b)
                r = int(a.shape[0])
                pages[j, slot, :r] = rows[:r].to(torch.int32)
                ranks[j, slot] = r
            lora.write_rows(j, rows, a, b, scaling=0.5)
    return lora


def random_adapters(in_full: int, outs: list[int]) -> dict[int, list[tuple[Any, Any]]]:
    """Slot -> per slice (A, B) at the slice's rank of ``RANKS`` (first ``len(outs)`` slices)."""
    adapters: dict[int, list[tuple[Any, Any]]] = {}
    for slot, per_slice in RANKS.items():
        adapters[slot] = [
            (torch.randn(r, in_full), torch.randn(n, r)) if r else (None, None)
            for r, n in zip(per_slice[: len(outs)], outs, strict=True)
        ]
    return adapters


def run(lora: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    meta = LoRAKernelMeta(len(TOKEN_SLOTS), MAX_LORAS, CPU)
    meta.prepare(torch.tensor(TOKEN_SLOTS))
    with lora.step.active(meta):
        return lora(x)


@pytest.mark.parametrize("size", [2, 4])
def test_column_parallel_lora_matches_unsharded(size: int) -> None:
    """qkv-like packed layer: A whole, B's rows of the rank's columns; the ranks' outputs,
    slice by slice, are the unsharded output's columns."""
    torch.manual_seed(0)
    hidden, outs = 24, [32, 16, 16]  # q | k | v
    names = ["q_proj", "k_proj", "v_proj"]
    weights = [torch.randn(n, hidden) for n in outs]
    biases = [torch.randn(n) for n in outs]
    adapters = random_adapters(hidden, outs)
    x = torch.randn(len(TOKEN_SLOTS), hidden)

    full = PackedLinear(hidden, dict(zip(names, outs, strict=True)), True, F32, CPU)
    for name, w, bias in zip(names, weights, biases, strict=True):
        full.load_shard("weight", name, w)
        full.load_shard("bias", name, bias)
    expected = run(lora_of(full, outs, adapters), x)  # [T, 64]
    assert not torch.allclose(expected, full(x))  # the adapters change the output

    local = [n // size for n in outs]
    parts = []
    for rank in range(size):
        starts = {name: rank * n for name, n in zip(names, local, strict=True)}
        layer = ColumnParallelLinear(
            hidden, dict(zip(names, local, strict=True)), starts, True, F32, CPU
        )
        for name, w, bias in zip(names, weights, biases, strict=True):
            layer.load_shard("weight", name, w)
            layer.load_shard("bias", name, bias)
        parts.append(run(lora_of(layer, local, adapters), x).split(local, dim=1))
    for j, name in enumerate(names):
        joined = torch.cat([p[j] for p in parts], dim=1)  # the ranks' columns of slice j
        off = sum(outs[:j])
        torch.testing.assert_close(joined, expected[:, off : off + outs[j]], msg=name)


@pytest.mark.parametrize("size", [2, 4])
def test_row_parallel_lora_matches_unsharded(size: int) -> None:
    """o_proj-like layer: A's columns of the rank's input rows, B whole; the delta is added to
    the rank's partial before the one all-reduce, and the partials sum to the unsharded output
    (bias counted once)."""
    torch.manual_seed(1)
    inner, out = 32, 24
    w, bias = torch.randn(out, inner), torch.randn(out)
    adapters = random_adapters(inner, [out])
    x = torch.randn(len(TOKEN_SLOTS), inner)

    full = Linear(inner, out, True, F32, CPU)
    full.load_shard("weight", "", w)
    full.load_shard("bias", "", bias)
    expected = run(lora_of(full, [out], adapters), x)

    local = inner // size
    total = torch.zeros_like(expected)
    for rank in range(size):
        tp = rank_group(rank, size)
        layer = RowParallelLinear(local, out, True, F32, CPU, tp)
        layer.load_shard("weight", "", w)
        layer.load_shard("bias", "", bias)
        run(lora_of(layer, [out], adapters), x[:, rank * local : (rank + 1) * local])
        assert isinstance(tp.group, LocalGroup) and len(tp.group.reduced) == 1  # one reduce
        total += tp.group.reduced[0]  # what the rank put into the all-reduce
    torch.testing.assert_close(total, expected)


@pytest.mark.parametrize("size", [2, 3])
def test_vocab_parallel_embedding_and_head(size: int) -> None:
    """A vocabulary the ranks cannot share evenly (padded shards): the lookups sum to the full
    embedding, and the gathered logit shards are the full logits."""
    torch.manual_seed(2)
    vocab, dim = 11, 8
    table, head = torch.randn(vocab, dim), torch.randn(vocab, dim)
    ids = torch.tensor([0, 3, 10, 5, 7, 10, 1])
    hidden = torch.randn(4, dim)
    emb_sum = torch.zeros(len(ids), dim)
    shards = []
    for rank in range(size):
        tp = rank_group(rank, size)
        emb = VocabParallelEmbedding(vocab, dim, F32, CPU, tp)
        emb.load_weight(table)
        emb_sum += emb(ids)
        lm = ParallelLMHead(dim, vocab, F32, CPU, tp)
        lm.load_shard("weight", "", head)
        shards.append(lm(hidden))
    torch.testing.assert_close(emb_sum, table[ids])
    torch.testing.assert_close(torch.cat(shards, dim=1)[:, :vocab], hidden @ head.T)
    assert gather_logits(shards[0], vocab, TPGroup()) is shards[0]  # one rank: nothing to do
