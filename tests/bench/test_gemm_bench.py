"""``loraplex bench gemm``: its argument types and one tiny run (the figures' shape, not speed)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from loraplex.bench.gemm import GemmBenchOptions, row_list, run_gemm, shape_list
from loraplex.kernels import native, packed_gemm


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
