"""The packed CPU GEMM (``csrc/gemm.c`` through ``packed_gemm``) against ``F.linear``, its
fallbacks, and the model layers that use it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.models.layers import Linear, PackedLinear
from loraplex.engine.models.loader import load_model
from loraplex.kernels import native, packed_gemm
from tests.utils.models import make_tiny_model
from tests.utils.native_spy import LibSpy

if native.library() is None and not os.environ.get("CI"):
    pytest.skip("native CPU kernels unavailable (no C compiler)", allow_module_level=True)

# fp32 sums of up to 600 products in another order than MKL's
TOL = dict(atol=2e-4, rtol=1e-4)


def width() -> int:
    w = packed_gemm.panel_width()
    assert w is not None
    return w


def test_pack_layout_and_padding(gen: torch.Generator) -> None:
    w = width()
    k, n = 5, 2 * w + 3  # two full panels and a partial one
    weight_t = torch.randn(k, n, generator=gen)  # [in, out]
    packed = packed_gemm.pack(weight_t)
    assert packed is not None
    assert packed.shape == (3, k, w) and packed.is_contiguous()
    for p in range(3):
        cols = min(w, n - p * w)
        assert torch.equal(packed[p, :, :cols], weight_t[:, p * w : p * w + cols])
        assert torch.count_nonzero(packed[p, :, cols:]) == 0  # zero padding
    assert packed.data_ptr() != weight_t.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_pack_is_none_outside_fp32(dtype: torch.dtype) -> None:
    assert packed_gemm.pack(torch.ones(4, 4, dtype=dtype)) is None


def test_pack_is_none_with_native_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "library", lambda: None)
    assert packed_gemm.pack(torch.ones(4, 4)) is None
    assert packed_gemm.panel_width() is None


# rows: the few-row tiles (1-3 rows, several panels at once), 1 tile, exact and uneven tile
# splits, one over a tile, the routing limit
ROWS = [1, 2, 3, 4, 12, 13, 14, 15, 37, 64, 128]  # around the 12- and 14-row tiles (AVX-512: 14)
# (in, out): tiny (one thread), off-panel widths, the SmolLM2 shapes (two threads)
SHAPES = [(1, 1), (7, 33), (64, 64), (130, 257), (576, 960), (1536, 576)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(
    spy: LibSpy, gen: torch.Generator, rows: int, k: int, n: int, with_bias: bool
) -> None:
    weight = torch.randn(n, k, generator=gen)  # [out, in]
    bias = torch.randn(n, generator=gen) if with_bias else None
    packed = packed_gemm.pack(weight.t())
    x = torch.randn(rows, k, generator=gen)  # [T, in]
    spy.calls.clear()
    y = packed_gemm.linear(x, weight, packed, bias)
    assert spy.calls == ["lp_gemm_packed"]
    assert y.shape == (rows, n)
    torch.testing.assert_close(y, F.linear(x, weight, bias), **TOL)


@pytest.mark.parametrize("rows", [2, 9, 40])  # a few-row tile; one row tile in place; packed
def test_strided_rows(spy: LibSpy, gen: torch.Generator, rows: int) -> None:
    k, n = 70, 45
    wide = torch.randn(rows, k + 11, generator=gen)
    x = wide[:, 3 : 3 + k]  # [rows, k], rows k + 11 apart, offset start
    weight = torch.randn(n, k, generator=gen)
    y = packed_gemm.linear(x, weight, packed_gemm.pack(weight.t()))
    assert "lp_gemm_packed" in spy.calls
    torch.testing.assert_close(y, F.linear(x, weight), **TOL)


def test_nonfinite_inputs_propagate(gen: torch.Generator) -> None:
    weight = torch.randn(40, 16, generator=gen)
    x = torch.randn(3, 16, generator=gen)
    x[1, 4] = float("nan")
    x[2, 0] = float("inf")
    y = packed_gemm.linear(x, weight, packed_gemm.pack(weight.t()))
    ref = F.linear(x, weight)
    assert torch.equal(y.isnan(), ref.isnan())
    torch.testing.assert_close(y[0], ref[0], **TOL)


def _fallback_cases(gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    k = 24
    return [
        ("columns not contiguous", torch.randn(k, 5, generator=gen).t()),
        ("3-D input", torch.randn(2, 3, k, generator=gen)),
        ("no rows", torch.randn(0, k)),
    ]


# rows past the AVX-512 builds' cap, prefill chunks: they stay packed where max_rows() allows
@pytest.mark.parametrize("rows", [129, 300, 1024])
@pytest.mark.parametrize(("k", "n"), [(130, 257), (576, 960), (1536, 576)])
def test_prefill_sized_batches(
    spy: LibSpy, gen: torch.Generator, rows: int, k: int, n: int
) -> None:
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    spy.calls.clear()
    y = packed_gemm.linear(x, weight, packed_gemm.pack(weight.t()), bias)
    limit = packed_gemm.max_rows()
    assert spy.calls == ([] if limit is not None and rows > limit else ["lp_gemm_packed"])
    torch.testing.assert_close(y, F.linear(x, weight, bias), **TOL)


@pytest.mark.parametrize(("width", "expected"), [(16, None), (32, 128), (64, 128)])
def test_row_cap_follows_the_build(
    monkeypatch: pytest.MonkeyPatch, width: int, expected: int | None
) -> None:
    monkeypatch.setattr(packed_gemm, "panel_width", lambda: width)
    assert packed_gemm.max_rows() == expected  # unmeasured widths keep the decode-sized cap


def test_rows_past_the_cap_go_to_f_linear(
    spy: LibSpy, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = torch.randn(17, 24, generator=gen)
    packed = packed_gemm.pack(weight.t())
    monkeypatch.setattr(packed_gemm, "max_rows", lambda: 8)
    for rows, calls in ((8, ["lp_gemm_packed"]), (9, [])):
        spy.calls.clear()
        x = torch.randn(rows, 24, generator=gen)
        torch.testing.assert_close(
            packed_gemm.linear(x, weight, packed), F.linear(x, weight), **TOL
        )
        assert spy.calls == calls, rows


def test_fallbacks_to_f_linear(spy: LibSpy, gen: torch.Generator) -> None:
    weight = torch.randn(17, 24, generator=gen)
    packed = packed_gemm.pack(weight.t())
    for why, x in _fallback_cases(gen):
        spy.calls.clear()
        y = packed_gemm.linear(x, weight, packed)
        assert spy.calls == [], why
        torch.testing.assert_close(y, F.linear(x, weight), **TOL)
    spy.calls.clear()
    x = torch.randn(4, 24, generator=gen)
    assert torch.equal(packed_gemm.linear(x, weight, None), F.linear(x, weight))  # not packed
    bias = torch.randn(34, generator=gen)[::2]  # a strided bias
    torch.testing.assert_close(
        packed_gemm.linear(x, weight, packed, bias), F.linear(x, weight, bias), **TOL
    )
    assert spy.calls == []


def test_bf16_input_falls_back(spy: LibSpy, gen: torch.Generator) -> None:
    weight = torch.randn(8, 16, generator=gen)
    packed = packed_gemm.pack(weight.t())
    x = torch.randn(2, 16, generator=gen).bfloat16()
    y = packed_gemm.linear(x, weight.bfloat16(), packed)
    assert "lp_gemm_packed" not in spy.calls and y.dtype == torch.bfloat16


def test_kernel_refuses_bad_strides() -> None:
    lib = native.library()
    assert lib is not None
    x, y = torch.zeros(2, 8), torch.zeros(2, 8)
    packed = packed_gemm.pack(torch.zeros(8, 8))
    assert packed is not None
    ptrs = (native.ptr(x), native.ptr(packed), None, native.ptr(y))
    assert lib.lp_gemm_packed(2, 8, 8, ptrs[0], 7, ptrs[1], ptrs[2], ptrs[3], 8, 1) == -1  # ldx<k
    assert lib.lp_gemm_packed(2, 8, 8, ptrs[0], 8, ptrs[1], ptrs[2], ptrs[3], 7, 1) == -1  # ldy<n
    assert lib.lp_gemm_packed(-1, 8, 8, ptrs[0], 8, ptrs[1], ptrs[2], ptrs[3], 8, 1) == -1


# ---- the model layers ---------------------------------------------------------------------------


def _filled(layer: Linear, gen: torch.Generator) -> Linear:
    for name, size in layer.output_slices.items():
        layer.load_shard("weight", name, torch.randn(size[1], layer.in_features, generator=gen))
        if layer.bias is not None:
            layer.load_shard("bias", name, torch.randn(size[1], generator=gen))
    return layer


def test_linear_layer_packs_and_matches(spy: LibSpy, gen: torch.Generator) -> None:
    cpu = torch.device("cpu")
    layer = _filled(PackedLinear(48, {"q": 40, "k": 8, "v": 8}, True, torch.float32, cpu), gen)
    assert layer.packed is None
    x = torch.randn(6, 48, generator=gen)
    unpacked = layer(x)
    assert spy.calls == []
    layer.pack_weight()
    assert layer.packed is not None
    spy.calls.clear()
    packed = layer(x)
    assert spy.calls == ["lp_gemm_packed"]
    torch.testing.assert_close(packed, unpacked, **TOL)
    torch.testing.assert_close(packed, F.linear(x, layer.weight, layer.bias), **TOL)
    # new weights: the stale packed copy is dropped, never used
    layer.load_shard("weight", "k", torch.randn(8, 48, generator=gen))
    assert layer.packed is None
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **TOL)


@pytest.mark.parametrize("tied", [False, True])
def test_loaded_model_packs_every_linear_and_the_head(
    spy: LibSpy, tmp_path: Path, gen: torch.Generator, tied: bool
) -> None:
    path = make_tiny_model(tmp_path / "m", "qwen2", tie_word_embeddings=tied)
    model, _ = load_model(path)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    assert (model.tied_head_packed is not None) == tied
    hidden = torch.randn(5, model.config.hidden_size, generator=gen)
    spy.calls.clear()
    logits = model.compute_logits(hidden)
    assert spy.calls == ["lp_gemm_packed"]
    head = model.model.embed_tokens.weight if tied else model.lm_head.weight  # type: ignore[union-attr]
    torch.testing.assert_close(logits, F.linear(hidden, head), **TOL)


def test_model_on_native_off_packs_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(native, "library", lambda: None)
    model, _ = load_model(make_tiny_model(tmp_path / "m", "llama", tie_word_embeddings=True))
    assert all(m.packed is None for m in model.modules() if isinstance(m, Linear))
    assert model.tied_head_packed is None
