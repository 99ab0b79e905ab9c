"""The bf16 packed GEMM (``csrc/gemm_bf16.c`` through ``packed_gemm``) against the torch
reference ``F.linear(x.bfloat16().float(), w.bfloat16().float(), bias)``, its layout, routing and
fallbacks. Where the CPU has no AVX512-BF16 the kernel tests skip, saying so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import native, packed_gemm
from tests.utils.native_spy import LibSpy

if native.library() is None and not os.environ.get("CI"):
    pytest.skip("native CPU kernels unavailable (no C compiler)", allow_module_level=True)

# fp32 sums of up to 1536 exact bf16 products in another order than torch's, outputs ~N(0, 2);
# rounding x or W to bf16 differently moves them by ~1e-2
TOL = dict(atol=1e-4, rtol=1e-4)


def _cpu_has_avx512_bf16() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(
        line.startswith("flags") and "avx512_bf16" in line.split() for line in text.splitlines()
    )


@pytest.fixture
def bf16() -> None:
    if not packed_gemm.bf16_supported():
        pytest.skip(
            "this CPU has no AVX512-BF16: the bf16 GEMM is not built here (lscpu lists "
            "avx512_bf16 where it is; AMX-only paths are not built yet)"
        )


def width() -> int:
    lib = native.library()
    assert lib is not None
    return int(lib.lp_gemm_bf16_panel_width())


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.bfloat16().float(), weight.bfloat16().float(), bias)


def packed_bf16(weight: torch.Tensor) -> torch.Tensor:
    packed = packed_gemm.pack(weight.t(), torch.bfloat16)  # [panels, ceil(in / 2), w, 2]
    assert packed is not None and packed.dtype == torch.bfloat16
    return packed


def test_supported_where_the_cpu_has_avx512_bf16() -> None:
    # -march=native builds the kernel exactly where the CPU lists the instructions
    assert packed_gemm.bf16_supported() == _cpu_has_avx512_bf16()
    cpu = torch.device("cpu")
    assert packed_gemm.packs_bf16(torch.float32, cpu) == packed_gemm.bf16_supported()
    assert not packed_gemm.packs_bf16(torch.float16, cpu)
    if not packed_gemm.bf16_supported():
        assert packed_gemm.pack(torch.ones(4, 4), torch.bfloat16) is None


def test_pack_layout_pairs_and_padding(bf16: None, gen: torch.Generator) -> None:
    w = width()
    k, n = 5, 2 * w + 3  # odd K: a zero pair half; two full panels and a partial one
    weight_t = torch.randn(k, n, generator=gen)  # [in, out]
    packed = packed_gemm.pack(weight_t, torch.bfloat16)
    assert packed is not None
    assert packed.shape == (3, 3, w, 2) and packed.is_contiguous()
    rounded = weight_t.to(torch.bfloat16)
    for p in range(3):
        cols = min(w, n - p * w)
        for kk in range(3):
            for j in range(2):
                got = packed[p, kk, :cols, j]
                if 2 * kk + j < k:
                    assert torch.equal(got, rounded[2 * kk + j, p * w : p * w + cols])
                else:
                    assert torch.count_nonzero(got) == 0  # K padded at its end
        assert torch.count_nonzero(packed[p, :, cols:]) == 0  # columns padded
    assert packed.data_ptr() != weight_t.data_ptr()
    # a bf16 weight packs to the same panels (rounding again changes nothing)
    again = packed_gemm.pack(rounded, torch.bfloat16)
    assert again is not None and torch.equal(again, packed)


def test_pack_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match=r"torch\.float32 or torch\.bfloat16"):
        packed_gemm.pack(torch.ones(4, 4), torch.float16)
    assert packed_gemm.pack(torch.ones(4, 4, dtype=torch.float16), torch.bfloat16) is None
    assert packed_gemm.pack(torch.ones(4), torch.bfloat16) is None  # not 2-D


def test_pack_is_none_with_native_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "library", lambda: None)
    assert packed_gemm.pack(torch.ones(4, 4), torch.bfloat16) is None
    assert not packed_gemm.bf16_supported()


# rows: each few-row group (1-6 rows: several panels at once), one 7- and one 14-row tile,
# uneven tile splits, prefill-sized batches
ROWS = [1, 2, 3, 4, 5, 6, 7, 14, 15, 64, 129, 300]
# (in, out): tiny (one thread), odd K with a partial panel, even K, the SmolLM2 shapes
SHAPES = [(1, 1), (7, 33), (64, 64), (131, 257), (576, 960), (1536, 576)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch_reference(
    bf16: None, spy: LibSpy, gen: torch.Generator, rows: int, k: int, n: int, with_bias: bool
) -> None:
    weight = torch.randn(n, k, generator=gen) * k**-0.5  # [out, in]
    bias = torch.randn(n, generator=gen) if with_bias else None
    packed = packed_bf16(weight)
    x = torch.randn(rows, k, generator=gen)  # [T, in]
    spy.calls.clear()
    y = packed_gemm.linear_any_rows(x, weight, packed, bias)
    assert spy.calls == ["lp_gemm_packed_bf16"]
    assert y is not None and y.shape == (rows, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, reference(x, weight, bias), **TOL)


def test_x_rounds_to_nearest_even_like_torch(bf16: None, gen: torch.Generator) -> None:
    # W = I: y is exactly bf16(x). Ties between two bf16 values go to the even one, as in torch
    k = 77
    x = torch.randn(3, k, generator=gen)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x40490FDB], dtype=torch.int64)
    x[0, :4] = ties.to(torch.int32).view(torch.float32)  # 1+2^-8, 1+3*2^-8, -(1+2^-8), pi
    x[1, :3] = torch.tensor([1e30, -3e-30, 65504.0])  # large and small normal magnitudes
    weight = torch.eye(k)
    y = packed_gemm.linear_any_rows(x, weight, packed_bf16(weight))
    assert y is not None
    assert torch.equal(y, x.bfloat16().float())
    assert y[0, 0] == 1.0 and y[0, 1] == 1.015625  # down to even, up to even


def test_rounds_x_not_only_the_weight(bf16: None, gen: torch.Generator) -> None:
    k, n = 576, 96
    weight = torch.randn(n, k, generator=gen) * k**-0.5
    x = torch.randn(4, k, generator=gen)
    y = packed_gemm.linear_any_rows(x, weight, packed_bf16(weight))
    assert y is not None
    unrounded_x = F.linear(x, weight.bfloat16().float())
    assert float((y - unrounded_x).abs().max()) > 10 * TOL["atol"]  # outside TOL
    torch.testing.assert_close(y, reference(x, weight, None), **TOL)


@pytest.mark.parametrize("rows", [2, 9, 40])  # a few-row tile; one row tile; several
@pytest.mark.parametrize("with_bias", [False, True])
def test_strided_x(
    bf16: None, spy: LibSpy, gen: torch.Generator, rows: int, with_bias: bool
) -> None:
    k, n = 71, 45
    wide = torch.full((rows, k + 11), float("nan"))  # NaN around x: read past it, y is NaN
    x = wide[:, 3 : 3 + k]  # [rows, k], rows k + 11 apart, offset start; odd K
    x.copy_(torch.randn(rows, k, generator=gen))
    weight = torch.randn(n, k, generator=gen) * k**-0.5
    bias = torch.randn(n, generator=gen) if with_bias else None
    packed = packed_bf16(weight)
    spy.calls.clear()
    y = packed_gemm.linear(x, weight, packed, bias)
    assert spy.calls == ["lp_gemm_packed_bf16"]
    torch.testing.assert_close(y, reference(x, weight, bias), **TOL)


def test_nonfinite_inputs_propagate(bf16: None, gen: torch.Generator) -> None:
    weight = torch.randn(40, 16, generator=gen)
    x = torch.randn(3, 16, generator=gen)
    x[1, 4] = float("nan")
    x[2, 0] = float("inf")
    y = packed_gemm.linear(x, weight, packed_bf16(weight))
    ref = reference(x, weight, None)
    assert torch.equal(y.isnan(), ref.isnan())
    torch.testing.assert_close(y[0], ref[0], **TOL)


def test_rows_past_the_cap_go_to_f_linear(
    bf16: None, spy: LibSpy, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = torch.randn(17, 24, generator=gen)
    bias = torch.randn(17, generator=gen)
    packed = packed_bf16(weight)
    monkeypatch.setattr(packed_gemm, "bf16_max_rows", lambda: 8)
    monkeypatch.setattr(packed_gemm, "max_rows", lambda: 0)  # the fp32 cap does not apply
    x = torch.randn(8, 24, generator=gen)
    spy.calls.clear()
    y = packed_gemm.linear(x, weight, packed, bias)
    assert spy.calls == ["lp_gemm_packed_bf16"]
    torch.testing.assert_close(y, reference(x, weight, bias), **TOL)
    x = torch.randn(9, 24, generator=gen)
    spy.calls.clear()
    assert torch.equal(packed_gemm.linear(x, weight, packed, bias), F.linear(x, weight, bias))
    assert spy.calls == []


def test_fallbacks_to_f_linear(bf16: None, spy: LibSpy, gen: torch.Generator) -> None:
    weight = torch.randn(17, 24, generator=gen)
    packed = packed_bf16(weight)
    cases = [
        ("columns not contiguous", torch.randn(24, 5, generator=gen).t(), None),
        ("3-D input", torch.randn(2, 3, 24, generator=gen), None),
        ("no rows", torch.randn(0, 24), None),
        ("a strided bias", torch.randn(4, 24, generator=gen), torch.randn(34, generator=gen)[::2]),
        ("an fp64 input", torch.randn(4, 24, generator=gen, dtype=torch.float64), None),
    ]
    for why, x, bias in cases:
        spy.calls.clear()
        w = weight.to(x.dtype)
        y = packed_gemm.linear(x, w, packed, bias)
        assert spy.calls == [], why
        assert torch.equal(y, F.linear(x, w, bias)), why
    # the fused LoRA call is fp32-only: None, so the caller runs the GEMM and the LoRA apart
    x = torch.randn(4, 24, generator=gen)
    assert packed_gemm.linear_lora(x, weight, packed, None, lambda _y: 0) is None
    assert spy.calls == []


def test_panels_of_another_shape_are_refused(bf16: None, gen: torch.Generator) -> None:
    weight = torch.randn(40, 24, generator=gen)  # 2 panels, 12 pair rows
    x = torch.randn(2, 24, generator=gen)
    for other in ((40, 26), (72, 24)):  # 13 pair rows; 3 panels
        wrong = packed_bf16(torch.randn(*other, generator=gen))
        with pytest.raises(ValueError, match="pack it with pack"):
            packed_gemm.linear(x, weight, wrong)


def test_kernel_refuses_bad_arguments(bf16: None) -> None:
    lib = native.library()
    assert lib is not None
    x, y = torch.zeros(2, 8), torch.zeros(2, 8)
    packed = packed_bf16(torch.zeros(8, 8))
    xp, pp, yp = native.ptr(x), native.ptr(packed), native.ptr(y)
    assert lib.lp_gemm_packed_bf16(2, 8, 8, xp, 7, pp, None, yp, 8, 1) == -1  # ldx < k
    assert lib.lp_gemm_packed_bf16(2, 8, 8, xp, 8, pp, None, yp, 7, 1) == -1  # ldy < n
    assert lib.lp_gemm_packed_bf16(-1, 8, 8, xp, 8, pp, None, yp, 8, 1) == -1
    assert lib.lp_gemm_packed_bf16(2, 8, 8, xp, 8, pp, None, yp, 8, 0) == -1  # no threads
    assert torch.count_nonzero(y) == 0  # nothing written


def test_fp32_panels_keep_the_fp32_kernel(spy: LibSpy, gen: torch.Generator) -> None:
    weight = torch.randn(40, 24, generator=gen)
    packed = packed_gemm.pack(weight.t())
    assert packed is not None and packed.dtype == torch.float32
    x = torch.randn(3, 24, generator=gen)
    spy.calls.clear()
    y = packed_gemm.linear(x, weight, packed)
    assert spy.calls == ["lp_gemm_packed"]
    torch.testing.assert_close(y, F.linear(x, weight), atol=2e-4, rtol=1e-4)
