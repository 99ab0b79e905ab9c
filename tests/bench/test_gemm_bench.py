"""``python -m benchmarks.gemm``: its argument types and one tiny run (the figures' shape, not speed)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from benchmarks.gemm import (
    GemmBenchOptions,
    add_gemm_arguments,
    options_from,
    row_list,
    run_gemm,
    shape_list,
)
from loraplex.kernels import native, packed_gemm


def test_options_from_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_gemm_arguments(parser)
    opts = options_from(parser.parse_args(["--rows", "1,4", "--weight-copies", "8"]))
    assert opts.rows == (1, 4) and opts.weight_copies == 8 and opts.iters == 0
    assert options_from(parser.parse_args([])).weight_copies == 1  # warm weights by default
    with pytest.raises(SystemExit):
        parser.parse_args(["--weight-copies", "0"])


def test_row_and_shape_lists() -> None:
    assert row_list("1, 64,1024") == (1, 64, 1024)
    assert shape_list("576x960,1536X576") == ((576, 960), (1536, 576))
    for bad in ("", "0", "64,64", "x", "20000"):
        with pytest.raises(argparse.ArgumentTypeError):
            row_list(bad)
    for bad in ("", "576", "0x4", "4x4x4", "axb", "70000x1"):
        with pytest.raises(argparse.ArgumentTypeError):
            shape_list(bad)


@pytest.mark.skipif(
    native.library() is None and not os.environ.get("CI"), reason="no native CPU kernels"
)
def test_tiny_run_writes_both_sides(tmp_path: Path) -> None:
    opts = GemmBenchOptions(
        rows=(1, 200), shapes=((24, 40),), repeats=2, iters=1, output_dir=str(tmp_path)
    )
    result = run_gemm(opts, say=lambda _line: None)
    (written,) = tmp_path.glob("gemm-*.json")
    assert json.loads(written.read_text())["rows"] == result["rows"]
    limit = packed_gemm.max_rows()
    for row, rows in zip(result["rows"], (1, 200), strict=True):
        assert row["rows"] == rows and len(row["packed_gflops_runs"]) == 2
        assert row["packed_gflops"] > 0 and row["f_linear_gflops"] > 0
        assert row["max_abs_diff"] < 1e-3  # both sides computed the same product
        assert row["packed_by_engine"] == (limit is None or rows <= limit)
    assert result["packed_max_rows"] == limit
    assert result["cpu"]


def test_tiny_run_times_the_bf16_kernel_where_built(tmp_path: Path) -> None:
    if native.library() is None or not packed_gemm.bf16_supported():
        pytest.skip("this CPU has no AVX512-BF16 (or no native kernels): no bf16 sides to time")
    opts = GemmBenchOptions(
        rows=(1, 200),
        shapes=((25, 40),),
        repeats=3,
        iters=1,
        weight_copies=2,  # two weights per shape, cycled through
        output_dir=str(tmp_path),
    )
    result = run_gemm(opts, say=lambda _line: None)
    assert result["options"]["weight_copies"] == 2
    assert result["bf16"] is True and result["bf16_max_rows"] == packed_gemm.bf16_max_rows()
    limit = packed_gemm.bf16_max_rows()
    for row, rows in zip(result["rows"], (1, 200), strict=True):
        for side in ("packed", "f_linear", "packed_bf16", "f_linear_bf16"):
            assert len(row[f"{side}_gflops_runs"]) == 3 and row[f"{side}_gflops"] > 0
        assert row["bf16_over_packed"] > 0 and row["bf16_over_best_f_linear"] > 0
        assert row["bf16_max_abs_diff"] < 1e-4  # the reference on bf16-rounded x and W
        assert row["bf16_packed_by_engine"] == (limit is None or rows <= limit)


def test_without_the_bf16_kernel_only_fp32_is_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native.library() is None:
        pytest.skip("no native CPU kernels")
    monkeypatch.setattr(packed_gemm, "bf16_supported", lambda: False)
    opts = GemmBenchOptions(
        rows=(3,), shapes=((8, 8),), repeats=2, iters=1, output_dir=str(tmp_path)
    )
    (row,) = run_gemm(opts, say=lambda _line: None)["rows"]
    assert row["packed_gflops"] > 0 and row["packed_bf16_gflops"] is None
    assert row["bf16_packed_by_engine"] is None
