"""The pure-torch paged attention backend: any device, any dtype; the reference for the others.

Decodes (one query token each) are attended in one batched, masked SDPA call over their blocks
gathered and padded to the longest; each prefill chunk gets its own SDPA call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from loraplex.engine.attention.base import (
    AttentionMetadata,
    BatchLayout,
    BatchSplit,
    PrefillSeq,
    SplitAttentionMetadata,
    split_batch,
)


@dataclass
class TorchAttentionMetadata(SplitAttentionMetadata):
    # all decode rows attended in one batched, masked SDPA call per layer
    decode_block_tables: torch.Tensor  # [D, max_blocks] int64, padded with the null block
    decode_mask: torch.Tensor  # [D, 1, 1, max_blocks * block_size] additive: 0 or -inf


class TorchPagedAttention:
    """Paged attention in plain torch (CPU, or any device as a reference).

    Layer cache layout ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V) so that
    ``cache[0].view(-1, H, D)`` addresses slots directly and ``index_select`` on blocks gathers whole
    blocks (contiguous runs of ``block_size * H * D`` values, not single slots).
    """

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype  # of q/k/v; masks are built additive in this dtype (no per-layer cast)

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed.to(self.device), float("-inf"))

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def copy_blocks(self, kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=kv_cache.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=kv_cache.device)
        # [layers, 2, num_blocks, ...]: one gather and one scatter over all layers at once
        kv_cache[:, :, dst] = kv_cache[:, :, src]

    def build_metadata(self, layout: BatchLayout) -> SplitAttentionMetadata:
        split = split_batch(layout)
        bs = layout.block_size
        if split.num_decodes:
            d_seq = split.decode_seq_lens  # [D]
            max_blocks = int((d_seq.max() + bs - 1) // bs)
            table = layout.block_tables[split.decode_idx, :max_blocks]  # [D, max_blocks]
            ctx = np.arange(max_blocks * bs, dtype=np.int64)
            allowed = ctx[None, :] < d_seq[:, None]  # [D, ctx] causal: keys at positions <= query's
            decode_tables = torch.from_numpy(table).to(self.device)
            decode_mask = self._additive(torch.from_numpy(allowed))[:, None, None, :]
        else:
            decode_tables = torch.zeros((0, 1), dtype=torch.long, device=self.device)
            decode_mask = torch.zeros((0, 1, 1, bs), dtype=self.dtype, device=self.device)
        return TorchAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            num_tokens=split.num_tokens,
            decode_rows=self._decode_rows(split.decode_rows),
            num_decodes=split.num_decodes,
            decode_block_tables=decode_tables,
            decode_mask=decode_mask,
            prefills=self._prefill_seqs(layout, split),
        )

    def _decode_rows(self, rows: np.ndarray) -> torch.Tensor | slice:
        """The decode rows as a slice when they are a run of the flat batch, else a tensor."""
        if len(rows) and rows[-1] - rows[0] == len(rows) - 1:
            return slice(int(rows[0]), int(rows[-1]) + 1)
        return torch.from_numpy(rows).to(self.device)

    def _prefill_seqs(self, layout: BatchLayout, split: BatchSplit) -> list[PrefillSeq]:
        bs = layout.block_size
        starts, qlens, seq_lens = layout.start_positions, layout.query_lens, layout.seq_lens
        prefills: list[PrefillSeq] = []
        for i in split.prefill_idx.tolist():
            start, qlen, slen = int(starts[i]), int(qlens[i]), int(seq_lens[i])
            n = (slen + bs - 1) // bs
            blocks = torch.from_numpy(layout.block_tables[i, :n]).to(self.device)  # [n]
            mask = None
            if start > 0:
                q_pos = torch.arange(start, slen)  # [q_len]
                k_pos = torch.arange(slen)  # [seq_len]
                mask = self._additive(k_pos[None, :] <= q_pos[:, None])  # [q_len, seq_len]
            row = int(split.qstart[i])
            prefills.append(PrefillSeq(row, row + qlen, start, blocks, mask))
        return prefills

    @staticmethod
    def write_kv(
        k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k/v at their slots (rounded to the cache's dtype where it is
        narrower: a bf16 cache beside fp32 activations); returns the layer's (k_cache,
        v_cache)."""
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, H_kv, D] each
        if k.dtype != k_cache.dtype:
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)
        return k_cache, v_cache

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchAttentionMetadata)
        num_tokens = q.shape[0]
        k_cache, v_cache = self.write_kv(k, v, kv_cache, metadata)

        if metadata.num_decodes == num_tokens and not metadata.prefills:
            return self._decode(q, k_cache, v_cache, metadata)  # all decodes: no scatter needed
        out = torch.empty_like(q)  # [T, H, D]
        if metadata.num_decodes:
            out[metadata.decode_rows] = self._decode(
                q[metadata.decode_rows], k_cache, v_cache, metadata
            )
        for seq in metadata.prefills:
            out[seq.token_start : seq.token_end] = self._prefill(seq, q, k, v, k_cache, v_cache)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [D, H, Dh]
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, Dh]
        v_cache: torch.Tensor,
        md: TorchAttentionMetadata,
    ) -> torch.Tensor:  # [D, H, Dh]
        n, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        blocks = md.decode_block_tables.view(-1)  # [D * nb]
        ctx = md.decode_mask.shape[-1]  # nb * block_size
        # Query heads of one KV head become that head's "query length": plain batched attention.
        qg = q.view(n, num_kv_heads, group, head_dim)  # [D, H_kv, G, Dh]
        # index_select of whole blocks: contiguous runs, faster than k_cache[tables]
        keys = k_cache.index_select(0, blocks).view(n, ctx, num_kv_heads, head_dim).transpose(1, 2)
        vals = v_cache.index_select(0, blocks).view(n, ctx, num_kv_heads, head_dim).transpose(1, 2)
        if keys.dtype != q.dtype:  # a bf16 cache: attention in the activations' dtype
            keys, vals = keys.to(q.dtype), vals.to(q.dtype)
        # keys, vals: [D, H_kv, ctx, Dh]
        out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=md.decode_mask)
        return out.reshape(n, num_heads, head_dim)  # [D, H, Dh]

    @staticmethod
    def _prefill(
        seq: PrefillSeq,
        q: torch.Tensor,  # [T, H, Dh]
        k: torch.Tensor,  # [T, H_kv, Dh]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, Dh]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:  # [q_len, H, Dh]
        # 4-D inputs (a batch of one): on the CPU, 3-D ones take SDPA's slow math path
        qs = q[seq.token_start : seq.token_end].transpose(0, 1)[None]  # [1, H, q_len, Dh]
        if seq.mask is None:  # first chunk: every key is in this step's k/v
            ks = k[seq.token_start : seq.token_end].transpose(0, 1)[None]  # [1, H_kv, q_len, Dh]
            vs = v[seq.token_start : seq.token_end].transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            seq_len = seq.mask.shape[1]
            ks = k_cache.index_select(0, seq.blocks).flatten(0, 1)[:seq_len].transpose(0, 1)
            vs = v_cache.index_select(0, seq.blocks).flatten(0, 1)[:seq_len].transpose(0, 1)
            # ks, vs: [H_kv, S, Dh]
            if ks.dtype != qs.dtype:  # a bf16 cache: attention in the activations' dtype
                ks, vs = ks.to(qs.dtype), vs.to(qs.dtype)
            out = F.scaled_dot_product_attention(
                qs, ks[None], vs[None], attn_mask=seq.mask[None, None], enable_gqa=True
            )
        return out[0].transpose(0, 1)  # [q_len, H, Dh]
