"""The Triton paged attention backend: one kernel launch per layer for the whole flat batch.

Per layer: ``kernels.kv_write.write_kv`` stores this step's K/V at their slots, then
``kernels.paged_attention.paged_attention`` attends every request (prefill chunks with a cached
prefix and decodes alike) reading K/V in place through the block tables. Per step,
``build_metadata`` packs the request boundaries, key counts and block tables into one int32 host
array and copies it to the device once; nothing in ``forward`` reads the device from the host,
so a decode step can be captured in a CUDA graph (``engine/cuda_graphs.py``) with the metadata
tensors as static buffers.

Same cache layout as the torch backend (``[2, num_blocks, block_size, H_kv, D]`` per layer): the
two are interchangeable and tested against each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplex.engine.attention.base import AttentionMetadata, BatchLayout
from loraplex.engine.attention.torch_backend import TorchPagedAttention
from loraplex.kernels.kv_write import write_kv
from loraplex.kernels.lora_shrink import HAS_TRITON, triton_interpreting
from loraplex.kernels.paged_attention import paged_attention

# Split-KV for decode batches: only when the batch's programs cannot fill the GPU and the
# longest context is long enough that each segment still covers this many keys.
SPLIT_MIN_KEYS_PER_SEGMENT = 512
MAX_SPLIT_SEGMENTS = 16


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    block_tables: torch.Tensor  # [B, W] int32, padded with the null block
    seq_lens: torch.Tensor  # [B] int32 keys of each request (cached + this step's)
    query_start_loc: torch.Tensor  # [B + 1] int32 first flat-batch row of each request, then T
    max_query_len: int  # host: picks the kernel's tile shape (an upper bound is fine)
    num_segments: int  # host: split-KV segments (1: off)


def split_segments(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int | None
) -> int:
    """Split-KV segments for a step: >1 only for decode batches too small to fill the GPU."""
    if num_sms is None or max_query_len > 1 or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    by_length = max_seq_len // SPLIT_MIN_KEYS_PER_SEGMENT
    by_occupancy = -(-2 * num_sms // programs)
    return max(1, min(MAX_SPLIT_SEGMENTS, by_length, by_occupancy))


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device``; None when it can."""
    if not HAS_TRITON:
        return "the `triton` package is not installed"
    if device.type != "cuda" and not triton_interpreting():
        return f"it runs on CUDA devices (or under TRITON_INTERPRET=1), not {device.type}"
    return None


class TritonPagedAttention(TorchPagedAttention):
    """Paged attention by the Triton kernels (cache shape and block copies: the torch backend's).

    ``num_segments``: a fixed split-KV segment count for every step (None: chosen per decode
    step from the device's SM count; always 1 off CUDA).
    """

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        num_kv_heads: int = 1,
        num_segments: int | None = None,
    ) -> None:
        why = triton_unavailable(device)
        if why is not None:
            raise ValueError(f"the triton attention backend cannot run here: {why}")
        super().__init__(device, dtype)
        self.num_kv_heads = num_kv_heads
        self.num_segments = num_segments
        self.num_sms: int | None = None
        if device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    def build_metadata(self, layout: BatchLayout) -> TritonAttentionMetadata:  # type: ignore[override]
        qlens = layout.query_lens
        num_seqs = len(qlens)
        seq_lens = layout.seq_lens  # [B]
        width = layout.block_tables.shape[1] if num_seqs else 1
        # one host buffer, one copy: [query_start_loc (B + 1) | seq_lens (B) | tables (B * W)]
        host = np.zeros(2 * num_seqs + 1 + num_seqs * width, dtype=np.int32)
        np.cumsum(qlens, out=host[1 : num_seqs + 1])
        host[num_seqs + 1 : 2 * num_seqs + 1] = seq_lens
        host[2 * num_seqs + 1 :] = layout.block_tables.reshape(-1)
        dev = torch.from_numpy(host).to(self.device)
        max_q = int(qlens.max()) if num_seqs else 1
        max_s = int(seq_lens.max()) if num_seqs else 0
        segments = self.num_segments or split_segments(
            num_seqs, self.num_kv_heads, max_q, max_s, self.num_sms
        )
        return TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            num_tokens=int(host[num_seqs]),
            block_tables=dev[2 * num_seqs + 1 :].view(num_seqs, width),
            seq_lens=dev[num_seqs + 1 : 2 * num_seqs + 1],
            query_start_loc=dev[: num_seqs + 1],
            max_query_len=max_q,
            num_segments=segments,
        )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, Dh]
        k: torch.Tensor,  # [T, H_kv, Dh]
        v: torch.Tensor,  # [T, H_kv, Dh]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, H_kv, Dh]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, Dh]
        assert isinstance(metadata, TritonAttentionMetadata)
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, H_kv, Dh] each
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, Dh]
        return paged_attention(
            q,
            k_cache,
            v_cache,
            out,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            max_query_len=metadata.max_query_len,
            num_segments=metadata.num_segments,
        )
