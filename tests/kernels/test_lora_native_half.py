"""The native CPU LoRA kernel (lp_lora_add) on fp16 and bf16 pools with fp32 x and y.

The kernel widens each pool row to fp32 as it reads it and sums in fp32, as
``add_lora_reference`` does on the same half-precision pool (``.float()``), so the two agree to
fp32 rounding (1e-5 here, where a misread element is off by ~1e-3 and a wrong page by ~1e3).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from importlib import resources
from pathlib import Path
from shutil import which

import pytest
import torch

from loraplex.kernels import native
from loraplex.kernels.lora_native import (
    POOL_DTYPES,
    NativeLoRAArgs,
    add_lora_native,
    native_fits,
)
from tests.utils.lora_pool import Case, make_case, reference

pytestmark = pytest.mark.skipif(
    native.library() is None and not os.environ.get("CI"),
    reason="loraplex's native CPU kernels are not built here (no C compiler)",
)

HALF = [torch.float16, torch.bfloat16]
ATOL = RTOL = 1e-5
QKV_WIDTHS = [32, 16, 24]


@pytest.fixture(params=HALF, ids=["fp16", "bf16"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    d: torch.dtype = request.param
    return d


def half_case(
    slots: list[int],
    ranks: list[int] | list[list[int]],
    in_features: int,
    widths: list[int],
    dtype: torch.dtype,
    *,
    max_num_tokens: int | None = None,
) -> Case:
    """``make_case`` with pools in ``dtype`` and fresh fp32 x and y (not rounded to dtype)."""
    case = make_case(slots, ranks, in_features, widths, dtype, max_num_tokens=max_num_tokens)
    gen = torch.Generator().manual_seed(1)
    T = len(slots)
    x = torch.randn(T, in_features, generator=gen)  # [T, in] fp32
    y0 = torch.randn(T, case.y0.shape[1], generator=gen)  # [T, out] fp32
    return dataclasses.replace(case, x=x, y0=y0)


def run(case: Case) -> torch.Tensor:
    y = case.y0.clone()
    add_lora_native(y, case.x, case.weights, case.meta)
    return y


def check(case: Case) -> torch.Tensor:
    """Native equals the reference on the same pool; base-model rows are untouched."""
    assert case.weights.dtype in HALF and case.x.dtype == torch.float32
    y = run(case)
    torch.testing.assert_close(y, reference(case), atol=ATOL, rtol=RTOL)
    base = torch.tensor([s < 0 for s in case.slots], dtype=torch.bool)
    assert torch.equal(y[base], case.y0[base])
    return y


MIXED_1_128 = [1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 100, 127, 128]


@pytest.mark.parametrize("widths", [[48], QKV_WIDTHS], ids=["1-slice", "3-slices"])
def test_mixed_ranks_1_to_128(dtype: torch.dtype, widths: list[int]) -> None:
    L = len(MIXED_1_128)
    slots = [int(s) for s in torch.randperm(3 * L, generator=torch.Generator().manual_seed(5))]
    slots = [s % (L + 1) - 1 for s in slots]  # each slot 2-3 tokens, base tokens among them
    per_slice = [[MIXED_1_128[(s + 3 * j) % L] for s in range(L)] for j in range(len(widths))]
    check(half_case(slots, per_slice, 32, widths, dtype))


def test_empty_adapters_and_slices(dtype: torch.dtype) -> None:
    """Slot 1: rank 0 in every slice; slot 2 targets only q; slot 3 q and v."""
    ranks = [[8, 0, 4, 16], [8, 0, 0, 0], [8, 0, 0, 16]]
    case = half_case([1, 0, 2, 3, 1, -1, 3, 2, 1], ranks, 32, QKV_WIDTHS, dtype)
    y = check(case)
    empty = torch.tensor([s == 1 for s in case.slots])
    assert torch.equal(y[empty], case.y0[empty])
    rows = torch.tensor([s in (2, 3) for s in case.slots])
    k_cols = slice(32, 48)  # slots 2 and 3 do not target k
    assert torch.equal(y[rows, k_cols], case.y0[rows, k_cols])


def test_only_empty_adapters(dtype: torch.dtype) -> None:
    case = half_case([0, -1, 1, 0], [0, 0], 32, QKV_WIDTHS, dtype)
    assert torch.equal(run(case), case.y0)


@pytest.mark.parametrize("num_adapters", [1, 2, 64, 256])
@pytest.mark.parametrize("widths", [[40], QKV_WIDTHS], ids=["1-slice", "3-slices"])
def test_many_adapters_in_one_batch(
    dtype: torch.dtype, num_adapters: int, widths: list[int]
) -> None:
    ranks = [(1, 4, 8, 2, 16, 3, 5)[s % 7] for s in range(num_adapters)]
    if num_adapters == 64:
        ranks[num_adapters // 2] = 64  # one large rank
    if num_adapters == 256:
        slots = [int(s) for s in torch.randperm(256, generator=torch.Generator().manual_seed(9))]
    else:
        slots = [t % num_adapters for t in range(max(8, 2 * num_adapters))] + [-1]
    case = half_case(slots, ranks, 32, widths, dtype)
    assert case.meta.num_segments == num_adapters
    check(case)


@pytest.mark.parametrize(
    "slots",
    [
        [0] * 5 + [1] * 3 + [2] * 8 + [3] * 13 + [-1] + [0] * 6,  # tiles of 1 to 8 tokens
        [3, 5, -1, 7, 3] + [0] * 203,  # a long run: tiles of 8 and a partial one
    ],
)
@pytest.mark.parametrize(
    ("in_features", "widths"),
    [(96, [96, 32, 32]), (37, [70, 5, 81]), (576, [576, 192, 192])],
    ids=["vectors", "tails", "smollm2-qkv"],
)
def test_tiles_and_column_tails(
    dtype: torch.dtype, slots: list[int], in_features: int, widths: list[int]
) -> None:
    """Tiles of every size (the 4-token pass and the single-token rest of the shrink); in and
    widths that are not multiples of a vector or of the expand's 64-column panel."""
    ranks = [8, 16, 4, 64, 8, 32, 0, 8]
    case = half_case(slots, ranks, in_features, widths, dtype, max_num_tokens=256)
    y = check(case)
    untouched = [t for t, s in enumerate(slots) if s < 0 or ranks[s] == 0]
    assert torch.equal(y[untouched], case.y0[untouched])


def test_fp16_subnormal_and_extreme_values_are_widened_exactly() -> None:
    """fp16 rows holding subnormals, the largest finite value and signed zeros: the kernel's
    widening equals torch's (an exact conversion), so the result equals the reference."""
    case = half_case([0, 1, 0], [4, 8], 32, [80], torch.float16)
    w = case.weights
    special = torch.tensor([6e-8, -6e-8, 3e-5, -1e-7, 65504.0, -65504.0, 0.0, -0.0])
    for p in w.slot_rows(0, 1).tolist():
        w.lora_a[0][p, :8] = special.half()
        w.lora_b[0][p, -8:] = special.flip(0).half()
    a = w.lora_a[0].float()
    assert ((a != 0) & (a.abs() < 6.1e-5)).any()  # subnormals are in the pool
    check(case)


def test_native_fits_half_pools_with_fp32_activations(dtype: torch.dtype) -> None:
    case = half_case([0, 1, 0], [4, 8], 32, [16, 8], dtype)
    w, x, y = case.weights, case.x, case.y0
    assert w.dtype in POOL_DTYPES
    assert native_fits(y, x, w)
    assert not native_fits(y.to(dtype), x.to(dtype), w)  # activations stay fp32
    assert not native_fits(y, x.to(dtype), w)
    assert not native_fits(y.t().contiguous().t(), x, w)  # column stride != 1
    dbl = make_case([0], [4], 32, [16], torch.float64)
    assert not native_fits(dbl.y0.float(), dbl.x.float(), dbl.weights)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        add_lora_native(dbl.y0.float(), dbl.x.float(), dbl.weights, dbl.meta)
    check(case)
    args = case.weights.caches["native"]
    assert isinstance(args, NativeLoRAArgs) and args.pool_dtype == POOL_DTYPES[dtype]


# --- rejection: checked before anything is written, as for fp32 pools ---


def rejects(case: Case) -> None:
    y = case.y0.clone()
    with pytest.raises(RuntimeError, match="lp_lora_add rejected"):
        add_lora_native(y, case.x, case.weights, case.meta)
    assert torch.equal(y, case.y0)


def test_rejects_a_slot_beyond_max_loras(dtype: torch.dtype) -> None:
    case = half_case([0, 1], [4, 8], 32, [16], dtype)
    case.meta.token_slots[1] = 5  # only 2 slots
    rejects(case)


@pytest.mark.parametrize("page", [-1, "pool_rows", 2**31 - 1])
def test_rejects_a_page_outside_its_pool(dtype: torch.dtype, page: int | str) -> None:
    case = half_case([0, 1, 0], [[4, 8], [4, 8]], 32, [16, 8], dtype)
    w = case.weights
    w.pages[1, 1, 7] = w.num_pages[1] if isinstance(page, str) else page  # the last rank-row
    rejects(case)


def test_rejects_a_rank_outside_its_range(dtype: torch.dtype) -> None:
    case = half_case([0, 1], [4, 8], 32, [16], dtype)
    case.weights.ranks[0, 0] = 9
    rejects(case)
    case.weights.ranks[0, 0] = -1
    rejects(case)


def test_checks_only_the_slots_it_uses(dtype: torch.dtype) -> None:
    case = half_case([0, 0, -1], [4, 8], 32, [16], dtype)
    case.weights.pages[0, 1, 0] = -5  # slot 1 is not in this batch
    check(case)


# --- the widening itself, every 16-bit pattern, with and without the vector instructions ---

WIDEN_HARNESS = r"""
#include <stdio.h>
#include "lp_simd.h"
int main(void) {
    static uint16_t in[65536];
    static float out[3][65536];
    for (int i = 0; i < 65536; i++) in[i] = (uint16_t)i;
    for (int i = 0; i < 65536; i++) out[0][i] = lp_f16_to_f32(in[i]);
    for (int i = 0; i < 65536; i += LP_VL) {
        lp_st(out[1] + i, lp_ld_f16(in + i));
        lp_st(out[2] + i, lp_ld_bf16(in + i));
    }
    return fwrite(out, sizeof out, 1, stdout) == 1 ? 0 : 1;
}
"""


@pytest.mark.parametrize("flags", [[], ["-march=native"]], ids=["portable", "native"])
def test_half_widening_is_exact_for_every_bit_pattern(tmp_path: Path, flags: list[str]) -> None:
    """lp_f16_to_f32, lp_ld_f16 and lp_ld_bf16 equal torch's conversion bit for bit (NaNs
    quieted as vcvtph2ps does). Without -march the portable C fallbacks are the ones built."""
    cc = next((c for c in (os.environ.get("CC", ""), "cc", "gcc", "clang") if c and which(c)), None)
    if cc is None:
        pytest.skip("no C compiler")
    src, exe = tmp_path / "widen.c", tmp_path / "widen"
    src.write_text(WIDEN_HARNESS)
    csrc = resources.files("loraplex.kernels").joinpath("csrc")
    build = [cc, "-O2", "-std=gnu11", *flags, f"-I{csrc}", "-o", str(exe), str(src)]
    subprocess.run(build, check=True, capture_output=True, timeout=120)
    got = torch.frombuffer(
        bytearray(subprocess.run([str(exe)], check=True, capture_output=True, timeout=60).stdout),
        dtype=torch.int32,
    )
    got = got.view(3, 65536)  # f16 scalar, f16 vector, bf16 vector: fp32 bit patterns
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)  # every 16-bit pattern
    want_f16 = bits.view(torch.float16).float().view(torch.int32)
    want_bf16 = bits.view(torch.bfloat16).float().view(torch.int32)
    assert torch.equal(got[0], want_f16)
    assert torch.equal(got[1], want_f16)
    assert torch.equal(got[2], want_bf16)
