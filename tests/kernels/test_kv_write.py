"""The Triton KV write (interpreted on the CPU) against its torch reference and the torch
backend's write: same cache bytes, pad rows (slot -1) write nothing."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.kv_write import PAD_SLOT, write_kv, write_kv_torch

triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "block_size"), [(2, 16, 4), (3, 80, 6), (1, 64, 16)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference_and_skips_pad_rows(
    kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks = 6
    # k, v: strided views of one [T, 2 * H_kv + 1, D] tensor, like the model's split qkv
    kv = torch.randn(7, 2 * kv_heads + 1, head_dim, generator=gen).to(dtype)
    k, v = kv[:, :kv_heads], kv[:, kv_heads : 2 * kv_heads]
    bs = block_size
    slots = torch.tensor([bs + 1, PAD_SLOT, 4 * bs, 2 * bs + 1, PAD_SLOT, bs + 2, 5 * bs + 3])
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    cache[:, 0] = 0  # the null block
    ref, ours = cache.clone(), cache.clone()
    write_kv_torch(k, v, ref[0], ref[1], slots)
    write_kv(k, v, ours[0], ours[1], slots)
    assert torch.equal(ours, ref)
    flat_k = ours[0].view(-1, kv_heads, head_dim)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k[t])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert torch.equal(flat_k[untouched], cache[0].view(-1, kv_heads, head_dim)[untouched])
    assert ours[:, 0].abs().sum() == 0  # the null block stays zero


def test_checks_and_early_return() -> None:
    k = torch.randn(3, 2, 16)
    cache = torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        write_kv(k, k, cache, cache, torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="k_cache must be"):
        write_kv(k, k, torch.zeros(4, 4, 3, 16), cache, torch.tensor([1, 2, 3]))
    write_kv(k[:0], k[:0], cache, cache, torch.zeros(0, dtype=torch.long))  # nothing to do
    assert cache.abs().sum() == 0
