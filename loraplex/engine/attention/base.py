"""Paged attention: the backend protocol and the records every backend shares.

A step's batch is flat: the query tokens of all scheduled requests, concatenated::

    tokens   | r0 prefill chunk (L0) | r1 decode (1) | r2 decode (1) | r3 prefill chunk (L3) |
    query_start_loc  0                 L0             L0+1            L0+2                 T

Each request owns a block table; token position ``p`` of a request lives in KV slot
``block_table[p // block_size] * block_size + p % block_size``. Block 0 is the null block: it stays
zeroed, and padding entries of padded block tables point at it (the mask hides them anyway).

``build_metadata`` runs once per step and prepares everything layer-independent (gather indices,
masks); ``forward`` runs once per layer and only writes K/V and attends. ``select.py`` chooses
the backend (``ModelConfig.attention_backend``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class BatchLayout:
    """Backend-neutral description of one step's flat batch (host arrays, built by the runner)."""

    query_lens: np.ndarray  # [B] int64, tokens computed this step per request
    start_positions: np.ndarray  # [B] int64, position of each request's first query token
    block_tables: np.ndarray  # [B, W] int64 each request's blocks, padded with 0 (null block)
    slot_mapping: torch.Tensor  # [T] int64 on device, KV slot of every query token
    block_size: int

    @property
    def seq_lens(self) -> np.ndarray:
        return self.start_positions + self.query_lens  # [B] keys visible to the last query token


@dataclass(frozen=True)
class BatchSplit:
    """A step's requests split into decodes (one query token) and prefill chunks (host arrays)."""

    qstart: np.ndarray  # [B + 1] first flat-batch row of each request, then T
    decode_idx: np.ndarray  # [D] request indices of the decodes
    decode_rows: np.ndarray  # [D] their flat-batch rows
    decode_seq_lens: np.ndarray  # [D] keys each decode attends to
    prefill_idx: np.ndarray  # [P] request indices of the prefill chunks

    @property
    def num_tokens(self) -> int:
        return int(self.qstart[-1])

    @property
    def num_decodes(self) -> int:
        return len(self.decode_idx)


def split_batch(layout: BatchLayout) -> BatchSplit:
    qlens = layout.query_lens
    qstart = np.zeros(len(qlens) + 1, dtype=np.int64)
    np.cumsum(qlens, out=qstart[1:])
    is_decode = qlens == 1
    decode_idx = np.flatnonzero(is_decode)
    return BatchSplit(
        qstart=qstart,
        decode_idx=decode_idx,
        decode_rows=qstart[decode_idx],
        decode_seq_lens=layout.seq_lens[decode_idx],
        prefill_idx=np.flatnonzero(~is_decode),
    )


@dataclass
class AttentionMetadata:
    """What every backend's metadata carries; backends subclass it with their own fields."""

    slot_mapping: torch.Tensor  # [T] int64
    num_tokens: int


class AttentionBackend(Protocol):
    """The seam between the model and the attention implementation (torch, Triton, ...)."""

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""
        ...

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer of ``kv_cache [layers, *layer_shape]``."""
        ...

    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata:
        """Once per step: everything the layers share."""
        ...

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # one layer's cache
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v at the metadata's slots, then attend causally over each request's blocks."""
        ...


@dataclass
class PrefillSeq:
    """A request with more than one query token this step (a prefill chunk)."""

    token_start: int  # first row in the flat batch
    token_end: int  # one past the last row
    start_pos: int  # position of the first query token (keys before it come from the cache)
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] int64, the blocks holding its keys
    mask: torch.Tensor | None  # [q_len, seq_len] additive (0 or -inf); None when start_pos == 0


@dataclass
class SplitAttentionMetadata(AttentionMetadata):
    """A step split into decode rows (query length 1) and prefill chunks, which the torch-based
    backends attend separately; each backend adds what its decode path reads."""

    decode_rows: torch.Tensor | slice  # [D] rows of the flat batch (a slice when contiguous)
    num_decodes: int
    prefills: list[PrefillSeq]
