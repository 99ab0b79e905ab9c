"""CUDA graphs for decode steps: one captured forward pass per batch bucket.

A decode step (every request computes one token) of ``n`` requests runs the graph of the smallest
bucket ``b >= n`` (1, 2, 4, 8, 16, 24, 32, ... up to ``max_num_seqs``). Every per-step input the
captured kernels read lives in a static buffer sized for the largest bucket and is refreshed in
place before each replay; the graph's kernels keep reading the same addresses::

    rows        0 .. n-1 (real)                    | n .. b-1 (pad)
    input_ids   this step's tokens                 | 0
    positions   their positions                    | 0
    slot_mapping their KV slots                    | PAD_SLOT (-1): the KV write skips the row
    seq_lens    start_pos + 1                      | 1 (attends the zeroed null block: finite)
    block_tables the requests' tables, 0-padded    | all 0 (the null block)
    LoRA meta   token -> adapter slot, segments    | slot -1 (base model)

Pad rows are never sampled: the runner reads rows ``0 .. n-1`` only.

LoRA: stale adapter metadata at replay is a known silent-wrong-adapter bug (TGI PR #2180, vLLM PR
#47725). Here the LoRA kernels are always captured (``LoRAKernelMeta.prepare`` runs before every
replay, into its preallocated buffers; a step without adapters leaves every segment empty, so the
kernels return at once on the device), and capture waits until the adapter stacks exist.

The capture strategy is injected: ``CudaGraphCapture`` on CUDA; ``DirectCalls`` (a "replay" calls
the same function again) on the CPU, where the bucket choice, the buffer refresh and the padding
are tested with the same code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from loraplex.engine.attention.base import AttentionBackend, BatchLayout
from loraplex.engine.attention.triton_backend import (
    TritonAttentionMetadata,
    TritonPagedAttention,
    split_segments,
)
from loraplex.kernels.kv_write import PAD_SLOT
from loraplex.kernels.meta import LoRAKernelMeta

if TYPE_CHECKING:
    from loraplex.lora.manager import LoRAManager

logger = logging.getLogger(__name__)

Forward = Callable[[], torch.Tensor]  # reads only the static buffers; returns [b, hidden]


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8, then ``max_num_seqs`` itself (ascending)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = {b for b in (1, 2, 4) if b <= max_num_seqs}
    sizes.update(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def bucket_for(num_seqs: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``num_seqs`` rows; None above the largest."""
    return next((b for b in buckets if b >= num_seqs), None)


class GraphCapture(Protocol):
    """Turns a forward function over static buffers into a replay function."""

    def capture(self, fn: Forward) -> Forward: ...


class DirectCalls:
    """The CPU stand-in for a graph: capture runs ``fn`` once (as a warm-up would), a replay
    calls it again. Counts captures and replays for tests."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, fn: Forward) -> Forward:
        fn()
        self.captures += 1

        def replay() -> torch.Tensor:
            self.replays += 1
            return fn()

        return replay


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph`` capture; all graphs share one memory pool (capture the largest
    bucket first so the smaller ones fit in its memory)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, fn: Forward) -> Forward:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, the allocator settles
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class GraphLoRA(Protocol):
    """What the graph runner needs of the LoRA manager: the step's metadata buffers, the context
    that makes the layers read them, and whether the adapter stacks are allocated yet."""

    @property
    def meta(self) -> LoRAKernelMeta: ...

    def active(self) -> AbstractContextManager[None]: ...

    def ready(self) -> bool: ...


class ManagerLoRA:
    """``GraphLoRA`` over ``loraplex.lora.manager.LoRAManager``."""

    def __init__(self, manager: LoRAManager) -> None:
        self._manager = manager

    @property
    def meta(self) -> LoRAKernelMeta:
        return self._manager.meta

    def active(self) -> AbstractContextManager[None]:
        return self._manager.step.active(self._manager.meta)

    def ready(self) -> bool:
        return all(layer.weights is not None for _, layer in self._manager.layers)


class Model(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: TritonAttentionMetadata
    ) -> torch.Tensor: ...


class DecodeGraphRunner:
    """Decode steps through captured forwards at batch buckets, inputs in static buffers.

    Every bucket is captured at the first decode step the graphs can run (largest first, so the
    smaller graphs reuse its memory pool), from buffers holding only pad rows: nothing is
    written to the KV cache while capturing. Capture waits for that step because with LoRA the
    adapter stacks must exist first (``GraphLoRA.ready``).
    """

    def __init__(
        self,
        model: Model,
        attn: TritonPagedAttention,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: GraphCapture,
        lora: GraphLoRA | None = None,
    ) -> None:
        self.model = model
        self.attn = attn
        self.lora = lora
        self.buckets = decode_buckets(max_num_seqs)
        self.block_size = block_size
        self._capture = capture
        self._graphs: dict[int, Forward] = {}
        self.disabled: str | None = None  # why capture failed: decode steps then run eagerly
        n = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        i64, i32 = torch.int64, torch.int32
        # the static inputs: every graph reads its first b rows of these, and nothing else
        self.input_ids = torch.zeros(n, dtype=i64, device=device)  # [N]
        self.positions = torch.zeros(n, dtype=i64, device=device)  # [N]
        self.slot_mapping = torch.full((n,), PAD_SLOT, dtype=i64, device=device)  # [N]
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=i32, device=device)  # [N, W]
        self.seq_lens = torch.ones(n, dtype=i32, device=device)  # [N]
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=device)  # [N + 1] constant
        self.token_slots = torch.full((n,), -1, dtype=i64, device=device)  # [N] LoRA slot per row
        # host staging: seq_lens | block tables, one copy per step
        self._host = np.zeros(n * (1 + self.max_blocks), dtype=np.int32)
        self._device_host = torch.zeros(n * (1 + self.max_blocks), dtype=i32, device=device)

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def can_run(self, layout: BatchLayout) -> bool:
        """A decode-only step within the buckets, with tables that fit the static buffer."""
        n = len(layout.query_lens)
        return (
            self.disabled is None
            and 0 < n <= self.buckets[-1]
            and bool((layout.query_lens == 1).all())
            and layout.block_tables.shape[1] <= self.max_blocks
            and (self.lora is None or self.lora.ready())
        )

    def _metadata(self, b: int) -> TritonAttentionMetadata:
        """Metadata over the first b rows of the static buffers (built once per bucket)."""
        segments = self.attn.num_segments or split_segments(
            b, self.attn.num_kv_heads, 1, self.max_model_len, self.attn.num_sms
        )
        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            num_tokens=b,
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            max_query_len=1,
            num_segments=segments,
        )

    def _forward_fn(self, b: int) -> Forward:
        metadata = self._metadata(b)
        ids, pos = self.input_ids[:b], self.positions[:b]

        def forward() -> torch.Tensor:
            with self._lora_context():
                return self.model(ids, pos, metadata)  # [b, hidden]

        return forward

    def _lora_context(self) -> AbstractContextManager[None]:
        return nullcontext() if self.lora is None else self.lora.active()

    def _capture_bucket(self, b: int) -> Forward:
        """Capture bucket b from the buffers as they are (``capture_all`` fills them with pads)."""
        if self.lora is not None:
            # every row on slot 0, so that the LoRA kernels are in the graph (a prepared meta
            # with no adapter token would skip them at capture, and in every replay)
            self.lora.meta.prepare(self.token_slots[:b].clamp(min=0))
        logger.info("capturing the decode graph of %d rows", b)
        fn = self._capture.capture(self._forward_fn(b))
        self._graphs[b] = fn
        if self.lora is not None:
            self.lora.meta.prepare(self.token_slots[:b])  # the buffers' own slots again
        return fn

    def refresh(
        self,
        input_ids: torch.Tensor,  # [n] int64 on the device
        positions: torch.Tensor,  # [n] int64
        layout: BatchLayout,
        lora_slots: np.ndarray,  # [n] int64 adapter slot per row (-1 = base)
    ) -> int:
        """Fill the static buffers for this step and return its bucket."""
        n = len(layout.query_lens)
        b = bucket_for(n, self.buckets)
        if b is None or not self.can_run(layout):
            raise ValueError(f"not a decode step the graphs can run ({n} rows)")
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:b].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:b].zero_()
        self.slot_mapping[:n].copy_(layout.slot_mapping)
        self.slot_mapping[n:b].fill_(PAD_SLOT)
        # host: seq_lens [b] | tables [b, w], one H2D copy. Pad rows attend one key of the null
        # block; columns past w keep older entries, which no row reads (it stops at its length).
        w = layout.block_tables.shape[1]
        host = self._host[: b * (1 + w)]
        host[:n] = layout.seq_lens
        host[n:b] = 1
        tables = host[b:].reshape(b, w)
        tables[:n] = layout.block_tables
        tables[n:] = 0
        staged = self._device_host[: host.size]
        staged.copy_(torch.from_numpy(host))
        self.seq_lens[:b].copy_(staged[:b])
        self.block_tables[:b, :w].copy_(staged[b:].view(b, w))
        self.block_tables[n:b, w:].zero_()  # pad rows: the null block everywhere
        if self.lora is not None:
            slots = self.token_slots[:b]
            slots[:n].copy_(torch.from_numpy(lora_slots))
            slots[n:].fill_(-1)
            self.lora.meta.prepare(slots)
        return b

    def capture_all(self) -> None:
        """Capture every bucket not captured yet, largest first, over pad rows only."""
        for b in reversed(self.buckets):
            if b in self._graphs:
                continue
            self.input_ids[:b].zero_()
            self.positions[:b].zero_()
            self.slot_mapping[:b].fill_(PAD_SLOT)
            self.seq_lens[:b].fill_(1)
            self.block_tables[:b].zero_()
            self.token_slots[:b].fill_(-1)
            self._capture_bucket(b)

    def run(
        self,
        input_ids: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        layout: BatchLayout,
        lora_slots: np.ndarray,  # [n] int64
    ) -> torch.Tensor | None:  # [n, hidden], valid until the next replay
        """Refresh the static buffers and replay the step's bucket (capturing all first).

        None when capture failed (logged once, with the error; ``disabled`` says why): the caller
        runs the step eagerly, as it does every later one. Capture writes no KV (pad rows only),
        so nothing is left half-done.
        """
        if len(self._graphs) < len(self.buckets) and self.can_run(layout):
            try:
                self.capture_all()
            except Exception as exc:  # a capture bug must not take the engine down
                self.disabled = f"{type(exc).__name__}: {exc}"
                self._graphs.clear()
                logger.warning("CUDA graph capture failed, decode runs eagerly: %s", self.disabled)
                return None
        b = self.refresh(input_ids, positions, layout, lora_slots)
        return self._graphs[b]()[: len(layout.query_lens)]

    def buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every static input buffer (name, tensor): for checks that addresses never change."""
        for name in (
            "input_ids",
            "positions",
            "slot_mapping",
            "block_tables",
            "seq_lens",
            "query_start_loc",
            "token_slots",
        ):
            yield name, getattr(self, name)


def build_decode_graphs(
    model: Model,
    attn: AttentionBackend,
    lora: LoRAManager | None,
    max_rows: int,
    max_model_len: int,
    block_size: int,
    device: torch.device,
    enforce_eager: bool,
) -> DecodeGraphRunner | None:
    """A runner's decode graphs: on CUDA with the triton backend, unless ``enforce_eager``.

    ``max_rows``: the most requests a decode step can have (max_num_seqs, at most
    max_num_batched_tokens)."""
    if enforce_eager or device.type != "cuda" or not isinstance(attn, TritonPagedAttention):
        return None
    return DecodeGraphRunner(
        model,
        attn,
        max_rows,
        max_model_len,
        block_size,
        device,
        CudaGraphCapture(),
        None if lora is None else ManagerLoRA(lora),
    )
