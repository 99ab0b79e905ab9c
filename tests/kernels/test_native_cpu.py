"""The native CPU kernels (``csrc/cpu_kernels.c`` through ``cpu_ops``) against their torch
references, and how ``native.py`` builds, caches and falls back."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_ops, native
from tests.utils.native_spy import LibSpy

# Without a compiler the wrappers run their torch paths and there is nothing to compare; on CI the
# compiler is part of the image, so a missing library fails test_library_builds_and_loads there.
if native.library() is None and not os.environ.get("CI"):
    pytest.skip("native CPU kernels unavailable (no C compiler)", allow_module_level=True)

TOL = dict(atol=1e-5, rtol=1e-5)
ROWS = [1, 7, 64, 300]  # 64 and 300 rows of the wider shapes cross LP_PAR_MIN: the OpenMP branch


def test_library_builds_and_loads() -> None:
    lib = native.library()
    assert lib is not None
    for name in ("lp_add_rms_norm", "lp_rope_neox", "lp_silu_mul", "lp_argmax_rows"):
        assert hasattr(lib, name)


# ---- rms_norm / add_rms_norm ------------------------------------------------------------------


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [1, 64, 577])
def test_rms_norm_matches_torch(spy: LibSpy, gen: torch.Generator, rows: int, dim: int) -> None:
    x = torch.randn(rows, dim, generator=gen) * 3.0  # [T, dim]
    w = torch.randn(dim, generator=gen)
    before = x.clone()
    out = cpu_ops.rms_norm(x, w, 1e-6)
    assert spy.calls == ["lp_add_rms_norm"]
    torch.testing.assert_close(out, F.rms_norm(before, (dim,), w, 1e-6), **TOL)
    assert torch.equal(x, before)  # the input is not modified


def test_rms_norm_small_rows_feel_eps(spy: LibSpy, gen: torch.Generator) -> None:
    x = torch.randn(4, 96, generator=gen)
    x[0] = 0.0  # rsqrt(eps) * 0: zeros, not NaN
    x[1] *= 1e-3  # mean square ~1e-6, comparable to eps
    x[2] *= 1e-4
    w = torch.randn(96, generator=gen)
    out = cpu_ops.rms_norm(x, w, 1e-5)
    assert spy.calls == ["lp_add_rms_norm"]
    assert torch.equal(out[0], torch.zeros(96))
    torch.testing.assert_close(out, F.rms_norm(x, (96,), w, 1e-5), **TOL)


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_strided_rows(spy: LibSpy, gen: torch.Generator, rows: int) -> None:
    dim = 577
    wide = torch.randn(rows, dim + 40, generator=gen)  # [T, dim + 40]
    x = wide[:, 5 : 5 + dim]  # [T, dim] rows dim + 40 apart, offset start
    assert x.stride() == (dim + 40, 1)
    w = torch.randn(dim, generator=gen)
    out = cpu_ops.rms_norm(x, w, 1e-5)
    assert spy.calls == ["lp_add_rms_norm"]
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.rms_norm(x.contiguous(), (dim,), w, 1e-5), **TOL)


def test_rms_norm_strided_weight(gen: torch.Generator) -> None:
    x = torch.randn(4, 64, generator=gen)
    w = torch.randn(128, generator=gen)[::2]  # [64] with stride 2: the torch path takes it
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6), **TOL)


def test_shapes_the_kernels_would_overrun_take_the_torch_path(
    spy: LibSpy, gen: torch.Generator
) -> None:
    x = torch.randn(4, 64, generator=gen)
    with pytest.raises(RuntimeError):  # torch refuses a weight of the wrong width, as it should
        cpu_ops.rms_norm(x, torch.randn(32, generator=gen), 1e-6)
    residual = torch.randn(4, 64, generator=gen)
    delta = torch.randn(1, 64, generator=gen)  # broadcasts in torch; the kernel would overrun
    expect = F.rms_norm(residual + delta, (64,), torch.ones(64), 1e-6)
    torch.testing.assert_close(cpu_ops.add_rms_norm(delta, residual, torch.ones(64), 1e-6), expect)
    qk = torch.randn(3, 2, 8, generator=gen)
    table = torch.randn(16, 4, generator=gen)
    with pytest.raises(RuntimeError):  # 2 positions for 3 rows: torch's shapes do not match
        cpu_ops.rope_(qk, torch.tensor([0, 1]), table, table)
    assert spy.calls == []


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [64, 577])
def test_add_rms_norm_updates_residual(
    spy: LibSpy, gen: torch.Generator, rows: int, dim: int
) -> None:
    wide = torch.randn(rows, dim + 8, generator=gen)
    residual = wide[:, 3 : 3 + dim]  # a strided view, updated in place
    delta_wide = torch.randn(rows, dim + 2, generator=gen)
    delta = delta_wide[:, 2:]
    w = torch.randn(dim, generator=gen)
    wide_before, delta_before = wide.clone(), delta.clone()
    expected_residual = wide_before[:, 3 : 3 + dim] + delta_before

    out = cpu_ops.add_rms_norm(delta, residual, w, 1e-6)

    assert spy.calls == ["lp_add_rms_norm"]
    assert torch.equal(residual, expected_residual)  # one fp32 add each: exact
    assert torch.equal(wide[:, :3], wide_before[:, :3])  # columns outside the view untouched
    assert torch.equal(wide[:, 3 + dim :], wide_before[:, 3 + dim :])
    assert torch.equal(delta, delta_before)
    torch.testing.assert_close(out, F.rms_norm(expected_residual, (dim,), w, 1e-6), **TOL)


# ---- rope -------------------------------------------------------------------------------------


def rope_tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # [P, Dh // 2]
    return freqs.cos(), freqs.sin()


def rope_expected(
    x: torch.Tensor, positions: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor
) -> torch.Tensor:
    cos = cos_t[positions].unsqueeze(1)  # [T, 1, Dh // 2]
    sin = sin_t[positions].unsqueeze(1)
    return cpu_ops.rope_reference(x, cos, sin)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 34)])
def test_rope_on_the_fused_qk_view(
    spy: LibSpy, gen: torch.Generator, rows: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    max_pos = 512
    cos_t, sin_t = rope_tables(max_pos, head_dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)  # [T, q + 2kv]
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    positions = torch.randint(0, max_pos, (rows,), generator=gen)
    positions[0] = max_pos - 1
    positions[-1 if rows > 1 else 0] = 0  # both ends of the table
    qkv_before = qkv.clone()
    expected = rope_expected(qk.clone(), positions, cos_t, sin_t)

    out = cpu_ops.rope_(qk, positions, cos_t, sin_t)

    assert spy.calls == ["lp_rope_neox"]
    assert out.data_ptr() == qk.data_ptr()  # rotated in place
    torch.testing.assert_close(qk, expected, **TOL)
    v_cols = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, v_cols], qkv_before[:, v_cols])  # v is not touched


@pytest.mark.parametrize("bad", [-1, 64, 10_000])
def test_rope_rejects_out_of_range_positions(spy: LibSpy, gen: torch.Generator, bad: int) -> None:
    cos_t, sin_t = rope_tables(64, 16)
    x = torch.randn(5, 3, 16, generator=gen)
    before = x.clone()
    positions = torch.tensor([0, 3, bad, 63, 1])
    with pytest.raises(RuntimeError, match="lp_rope_neox"):
        cpu_ops.rope_(x, positions, cos_t, sin_t)
    assert torch.equal(x, before)  # checked before anything is written


# ---- silu_mul ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [64, 577])
def test_silu_mul_matches_torch(spy: LibSpy, gen: torch.Generator, rows: int, inter: int) -> None:
    wide = torch.randn(rows, 2 * inter + 16, generator=gen) * 4.0
    gate_up = wide[:, 8 : 8 + 2 * inter]  # [T, 2 * inter], strided rows
    out = cpu_ops.silu_mul(gate_up, inter)
    assert spy.calls == ["lp_silu_mul"]
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    torch.testing.assert_close(out, F.silu(gate) * up, **TOL)


def test_silu_mul_extreme_inputs(spy: LibSpy, gen: torch.Generator) -> None:
    values = torch.tensor([100.0, -100.0, 1e4, -1e4, 88.5, -87.5, 0.0, -0.0, 20.0, -20.0, 1e-30])
    gate = values.repeat(3)  # 33: every value in the vector lanes (8 or 16) and in the tail
    inter = gate.numel()
    up = torch.randn(3, inter, generator=gen) * 100.0
    up[1] = 1.0
    gate_up = torch.cat([gate.expand(3, inter), up], dim=1)  # [3, 2 * inter]
    expected = F.silu(gate) * up
    out = cpu_ops.silu_mul(gate_up, inter)
    assert spy.calls == ["lp_silu_mul"]
    assert torch.isfinite(expected).all()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOL)


def test_silu_mul_propagates_nan(spy: LibSpy) -> None:
    nan = float("nan")
    gate = torch.tensor([[nan, 1.0, -3.0, nan]]).repeat(1, 9)  # 36: vector lanes and the tail
    up = torch.tensor([[2.0, nan, 5.0, 0.0]]).repeat(1, 9)
    out = cpu_ops.silu_mul(torch.cat([gate, up], dim=1), 36)
    assert spy.calls == ["lp_silu_mul"]
    assert torch.isnan(out).tolist() == [[True, True, False, True] * 9]
    torch.testing.assert_close(out, F.silu(gate) * up, equal_nan=True, **TOL)


# ---- argmax_rows ------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("vocab", [211, 1000])
def test_argmax_matches_torch(spy: LibSpy, gen: torch.Generator, rows: int, vocab: int) -> None:
    # coarse values: many rows have their maximum more than once (the first one wins)
    x = torch.randint(-20, 20, (rows, vocab), generator=gen).float()
    wide = torch.full((rows, vocab + 7), 1e9)
    wide[:, 7:] = x
    view = wide[:, 7:]  # strided rows; the larger values left of the view must be ignored
    out = cpu_ops.argmax_rows(view)
    assert spy.calls == ["lp_argmax_rows"]
    assert out.dtype == torch.int64
    assert torch.equal(out, x.argmax(dim=-1))


def test_argmax_special_rows(spy: LibSpy) -> None:
    inf, nan = float("inf"), float("nan")
    x = torch.tensor(
        [
            [1.0, 3.0, 2.0, 3.0, 0.0, 3.0],  # tie: the first
            [-inf] * 6,  # all -inf: index 0
            [-inf, -inf, -inf, -inf, -inf, -5.0],  # the only finite value, last
            [1.0, nan, 5.0, nan, 9.0, 0.0],  # first NaN wins over larger values
            [nan, 1.0, 2.0, 3.0, 4.0, 5.0],  # NaN first
            [inf, 1.0, inf, 2.0, 3.0, nan],  # NaN after +inf
            [0.0, -0.0, 0.0, -1.0, -2.0, -3.0],  # signed zeros compare equal
        ]
    )
    out = cpu_ops.argmax_rows(x)
    assert spy.calls == ["lp_argmax_rows"]
    assert out.tolist() == torch.argmax(x, dim=-1).tolist() == [1, 0, 5, 1, 0, 5, 0]


@pytest.mark.parametrize("maxima", [[0, 49_151], [1], [24_575, 30_000], [49_150, 49_151], [49_151]])
def test_argmax_one_row_full_vocab(spy: LibSpy, gen: torch.Generator, maxima: list[int]) -> None:
    x = torch.randn(1, 49_152, generator=gen)  # [S=1, V]: crosses LP_PAR_MIN with a single row
    x[0, maxima] = 50.0
    out = cpu_ops.argmax_rows(x)
    assert spy.calls == ["lp_argmax_rows"]
    assert out.tolist() == torch.argmax(x, dim=-1).tolist() == [maxima[0]]


# ---- torch fallbacks --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_uses_torch(
    spy: LibSpy, gen: torch.Generator, dtype: torch.dtype
) -> None:
    x = torch.randn(7, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), w, 1e-6))

    residual, delta = x.clone(), torch.randn(7, 96, generator=gen).to(dtype)
    out = cpu_ops.add_rms_norm(delta, residual, w, 1e-6)
    assert torch.equal(residual, x + delta)
    assert torch.equal(out, F.rms_norm(x + delta, (96,), w, 1e-6))

    cos_t, sin_t = rope_tables(32, 16)
    q = torch.randn(7, 3, 16, generator=gen).to(dtype)
    positions = torch.arange(7)
    got = cpu_ops.rope_(q, positions, cos_t.to(dtype), sin_t.to(dtype))
    assert torch.equal(got, rope_expected(q, positions, cos_t.to(dtype), sin_t.to(dtype)))

    assert torch.equal(cpu_ops.silu_mul(x, 48), F.silu(x[:, :48]) * x[:, 48:])
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1))
    assert spy.calls == []


def test_non_cpu_inputs_use_torch(spy: LibSpy) -> None:
    meta = torch.device("meta")
    x = torch.empty(7, 96, device=meta)
    w = torch.empty(96, device=meta)
    assert cpu_ops.rms_norm(x, w, 1e-6).device == meta
    assert cpu_ops.add_rms_norm(x, torch.empty(7, 96, device=meta), w, 1e-6).device == meta
    cos_t = torch.empty(32, 8, device=meta)
    q = torch.empty(7, 3, 16, device=meta)
    assert cpu_ops.rope_(q, torch.arange(7, device=meta), cos_t, cos_t).shape == (7, 3, 16)
    assert cpu_ops.silu_mul(x, 48).shape == (7, 48)
    assert cpu_ops.argmax_rows(x).shape == (7,)
    assert spy.calls == []


def test_layouts_the_kernels_cannot_read_use_torch(spy: LibSpy, gen: torch.Generator) -> None:
    x = torch.randn(96, 7, generator=gen).t()  # [7, 96] with column stride 7
    w = torch.randn(96, generator=gen)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), w, 1e-6))
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1))

    cos_t, sin_t = rope_tables(32, 16)
    q = torch.randn(7, 16, 3, generator=gen).transpose(1, 2)  # [7, 3, 16], heads not contiguous
    before = q.clone()
    got = cpu_ops.rope_(q, torch.arange(7), cos_t, sin_t)
    torch.testing.assert_close(got, rope_expected(before, torch.arange(7), cos_t, sin_t))
    assert torch.equal(q, before)  # the torch path returns a new tensor
    assert spy.calls == []


def test_native_off_gives_the_same_results(
    monkeypatch: pytest.MonkeyPatch, gen: torch.Generator
) -> None:
    x = torch.randn(64, 577, generator=gen)
    w = torch.randn(577, generator=gen)
    on = cpu_ops.rms_norm(x, w, 1e-6), cpu_ops.silu_mul(x[:, :576], 288)
    with monkeypatch.context() as env:
        env.setenv(native.NATIVE_ENV, "0")
        native.library.cache_clear()
        try:
            assert native.library() is None
            off = cpu_ops.rms_norm(x, w, 1e-6), cpu_ops.silu_mul(x[:, :576], 288)
        finally:
            native.library.cache_clear()
    for a, b in zip(on, off, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert native.library() is not None


# ---- building, caching and falling back -------------------------------------------------------


@pytest.fixture
def cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A fresh ``$LORAPLEX_CACHE_DIR`` and an empty ``library()`` cache; both restored after."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(root))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    native.library.cache_clear()
    yield root
    native.library.cache_clear()  # runs before monkeypatch restores the environment


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cache_root: Path) -> Path:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("CC", "loraplex-no-such-compiler")
    monkeypatch.setenv("PATH", str(empty))
    return cache_root


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if not p.is_dir())


def test_build_without_compiler_says_how_to_install_one(no_compiler: Path) -> None:
    with pytest.raises(native.NativeBuildError, match="apt-get install"):
        native.build_library()
    assert files_under(no_compiler) == []


def test_library_without_compiler_warns_once(
    no_compiler: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.library() is None
        assert native.library() is None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "no C compiler" in warnings[0].getMessage()


def test_required_mode_raises_without_compiler(
    no_compiler: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.NATIVE_ENV, "1")
    with pytest.raises(native.NativeBuildError, match=r"LORAPLEX_NATIVE=1.*no C compiler"):
        native.library()


def test_off_mode_neither_builds_nor_warns(
    no_compiler: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(native.NATIVE_ENV, "off")
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.library() is None
    assert caplog.records == []
    assert not native.usable(torch.zeros(2))


def test_invalid_mode_names_the_variable(cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.NATIVE_ENV, "maybe")
    with pytest.raises(ValueError, match="LORAPLEX_NATIVE='maybe'"):
        native.library()


FAILING_CC = """#!/bin/sh
# writes a partial output, then fails like a compiler with an error
out=""
while [ $# -gt 0 ]; do
    if [ "$1" = "-o" ]; then out="$2"; fi
    shift
done
if [ -n "$out" ]; then echo partial > "$out"; fi
echo "cpu_kernels.c:1:1: error: loraplex-test-compiler-says-no" >&2
exit 1
"""


def test_failing_compiler_leaves_no_partial_library(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cc = tmp_path / "bin" / "fake-cc"
    cc.parent.mkdir()
    cc.write_text(FAILING_CC)
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(native.NativeBuildError, match="loraplex-test-compiler-says-no"):
        native.build_library()
    assert (cache_root / "native").is_dir()  # the build did run
    assert files_under(cache_root) == []
    assert native.library() is None  # auto mode: a warning, then the torch paths


def test_build_caches_one_library_and_reuses_it(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator
) -> None:
    native.build_library()
    built = files_under(cache_root)
    assert [p.name for p in built] == ["libloraplex_cpu.so"]
    assert built[0].parent.parent == cache_root / "native"
    mtime = built[0].stat().st_mtime_ns

    def no_rebuild(*args: Any) -> None:
        raise AssertionError("the cached library was rebuilt")

    monkeypatch.setattr(native, "_build", no_rebuild)
    lib = native.build_library()
    assert files_under(cache_root) == built
    assert built[0].stat().st_mtime_ns == mtime
    # the reloaded library computes
    x = torch.randn(3, 50, generator=gen)
    out = torch.empty(3, dtype=torch.int64)
    assert lib.lp_argmax_rows(native.ptr(x), 50, 3, 50, native.ptr(out), 1) == 0
    assert torch.equal(out, x.argmax(dim=-1))
