"""Paged attention on the CPU with loraplex's native decode kernel (fp32 activations; the KV
cache fp32 or bf16).

Prefill chunks go through the torch backend's SDPA path unchanged (large GEMM-shaped work, where
SDPA is fast). Decode rows, one query token each, go to ``lp_paged_decode_attention`` in
``loraplex/kernels/csrc/cpu_kernels.c``: it reads each sequence's keys and values in place from
the paged cache, through its block table, instead of gathering every sequence's blocks padded to
the longest one and running a masked SDPA over them, which is what the torch backend does and what
made attention a large share of a decode step on 2 CPU threads (loraplex bench throughput
with ``--attention-backend torch`` and ``native`` compares).

``select.select_backend`` picks this backend (``auto``) on the CPU in fp32 when the native
kernels are available (``loraplex.kernels.native``) and the kernel takes the model's heads, and
the torch backend otherwise; ``LORAPLEX_NATIVE=0`` turns the native kernels off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from loraplex.engine.attention.base import (
    AttentionMetadata,
    BatchLayout,
    SplitAttentionMetadata,
    split_batch,
)
from loraplex.engine.attention.torch_backend import TorchPagedAttention
from loraplex.kernels import native

# query heads per KV head the kernel handles (LP_MAX_GROUP in cpu_kernels.c)
MAX_GROUP = 64
# the cache element types it reads (LP_F32, LP_BF16 in lp_simd.h)
_KV_CODES = {torch.float32: 0, torch.bfloat16: 2}


@dataclass
class NativeAttentionMetadata(SplitAttentionMetadata):
    # host arrays the kernel reads through pointers; kept alive here for the whole step
    decode_rows_host: np.ndarray  # [D] int64 flat-batch row of each decode
    decode_tables_host: np.ndarray  # [D, W] int64 C-contiguous block tables
    decode_seq_lens_host: np.ndarray  # [D] int64


class NativePagedAttention(TorchPagedAttention):
    """The torch backend with decode attention done by the native kernel."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"the native attention backend is CPU fp32 only, got {device} {dtype}")
        lib = native.library()
        if lib is None:
            raise RuntimeError("the native CPU kernels are not available")
        super().__init__(device, dtype)
        self._lib = lib

    def build_metadata(self, layout: BatchLayout) -> NativeAttentionMetadata:
        split = split_batch(layout)
        bs = layout.block_size
        seq_lens = np.ascontiguousarray(split.decode_seq_lens, dtype=np.int64)
        width = int((seq_lens.max() + bs - 1) // bs) if split.num_decodes else 1
        tables = np.ascontiguousarray(layout.block_tables[split.decode_idx, :width], np.int64)
        return NativeAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            num_tokens=split.num_tokens,
            decode_rows=self._decode_rows(split.decode_rows),
            num_decodes=split.num_decodes,
            prefills=self._prefill_seqs(layout, split),
            decode_rows_host=np.ascontiguousarray(split.decode_rows, dtype=np.int64),
            decode_tables_host=tables,
            decode_seq_lens_host=seq_lens,
        )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [T, H, Dh]
        k: torch.Tensor,  # [T, H_kv, Dh]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, H_kv, Dh]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, Dh]
        assert isinstance(metadata, NativeAttentionMetadata)
        k_cache, v_cache = self.write_kv(k, v, kv_cache, metadata)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if metadata.num_decodes:
            self._decode_native(q, k_cache, v_cache, metadata, out)
        for seq in metadata.prefills:
            out[seq.token_start : seq.token_end] = self._prefill(seq, q, k, v, k_cache, v_cache)
        return out

    def _decode_native(
        self,
        q: torch.Tensor,  # [T, H, Dh], rows may be strided (a view of the fused qk)
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, Dh]
        v_cache: torch.Tensor,
        md: NativeAttentionMetadata,
        out: torch.Tensor,  # [T, H, Dh] contiguous
    ) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the native decode kernel needs a contiguous KV cache")
        kv_code = _KV_CODES.get(k_cache.dtype)
        if kv_code is None:
            raise ValueError(
                f"the native decode kernel reads fp32 or bf16 caches, not {k_cache.dtype}"
            )
        tables = md.decode_tables_host
        rc = self._lib.lp_paged_decode_attention(
            native.ptr(q),
            q.stride(0),
            md.decode_rows_host.ctypes.data,
            md.num_decodes,
            native.ptr(k_cache),
            native.ptr(v_cache),
            kv_code,
            tables.ctypes.data,
            tables.shape[1],
            md.decode_seq_lens_host.ctypes.data,
            k_cache.shape[1],
            num_heads,
            k_cache.shape[2],
            head_dim,
            1.0 / math.sqrt(head_dim),
            native.ptr(out),
            out.stride(0),
            native.num_threads(),
        )
        if rc != 0:
            raise RuntimeError(
                f"lp_paged_decode_attention rejected its arguments (heads {num_heads}/"
                f"{k_cache.shape[2]}, seq_lens up to {int(md.decode_seq_lens_host.max())}, "
                f"table width {tables.shape[1]} x block {k_cache.shape[1]})"
            )
