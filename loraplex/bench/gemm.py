"""``loraplex bench gemm``: the packed CPU GEMM (``kernels/packed_gemm``) against ``F.linear``
(torch's BLAS, MKL on x86) per row count, on a model's linear shapes.

The measurement behind ``packed_gemm.max_rows()``: up to which batch size the engine's linears
should take the packed kernel. For each ``--rows`` value, ``--repeats`` pairs alternate which
side goes first; each side runs every shape (SmolLM2-135M's fused q|k|v, o, gate|up and down
projections by default) ``--iters`` times, weights warm, and the figure is GFLOP/s over all of
them. Reports per row count the median of each side, the median of the paired ratios, the
largest difference between the two results, and whether this build routes that row count to
the packed kernel. Writes ``gemm-<time>.json`` to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.argtypes import positive_int

Log = Callable[[str], None]

MAX_ROWS = 16384
MAX_DIM = 65536
# (in, out) of SmolLM2-135M's linears as the engine fuses them: q|k|v, o, gate|up, down
SMOLLM2_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def row_list(text: str) -> tuple[int, ...]:
    """``1,64,1024``: distinct row counts from 1 to ``MAX_ROWS``."""
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected row counts such as 64,1024; got {text!r}"
        ) from None
    if not values or any(not 1 <= v <= MAX_ROWS for v in values):
        raise argparse.ArgumentTypeError(f"row counts must be 1 to {MAX_ROWS}; got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"a row count is repeated in {text!r}")
    return values


def shape_list(text: str) -> tuple[tuple[int, int], ...]:
    """``576x960,1536x576``: (in, out) pairs from 1 to ``MAX_DIM``."""
    shapes: list[tuple[int, int]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        dims = part.lower().split("x")
        try:
            k, n = (int(d) for d in dims)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected shapes IN x OUT such as 576x960,1536x576; got {part!r}"
            ) from None
        if not (1 <= k <= MAX_DIM and 1 <= n <= MAX_DIM):
            raise argparse.ArgumentTypeError(f"dimensions must be 1 to {MAX_DIM}; got {part!r}")
        shapes.append((k, n))
    if not shapes:
        raise argparse.ArgumentTypeError(f"expected at least one shape; got {text!r}")
    return tuple(shapes)


@dataclass(frozen=True)
class GemmBenchOptions:
    rows: tuple[int, ...] = (1, 8, 64, 128, 256, 1024, 2048)
    shapes: tuple[tuple[int, int], ...] = SMOLLM2_SHAPES
    repeats: int = 7
    iters: int = 0  # 0: enough for about 20 ms per side at each row count
    threads: int | None = None  # torch intra-op threads, which the packed kernel also uses
    output_dir: str = "bench-results"


def add_gemm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=row_list, default=GemmBenchOptions.rows, metavar="M,...")
    p.add_argument(
        "--shapes",
        type=shape_list,
        default=SMOLLM2_SHAPES,
        metavar="INxOUT,...",
        help="linear shapes (default: SmolLM2-135M's q|k|v, o, gate|up, down)",
    )
    p.add_argument("--repeats", type=positive_int, default=7, help="paired runs per row count")
    p.add_argument(
        "--iters",
        type=positive_int,
        default=None,
        help="calls per shape and side (default: ~20 ms)",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="default: torch's")
    p.add_argument("--output-dir", default="bench-results")


def options_from(args: argparse.Namespace) -> GemmBenchOptions:
    return GemmBenchOptions(
        rows=args.rows,
        shapes=args.shapes,
        repeats=args.repeats,
        iters=args.iters or 0,
        threads=args.threads,
        output_dir=args.output_dir,
    )


def run_gemm(opts: GemmBenchOptions, say: Log = print) -> dict[str, Any]:
    import torch

    from loraplex.bench.common import machine
    from loraplex.kernels import packed_gemm

    if packed_gemm.panel_width() is None:
        raise RuntimeError("the native CPU kernels did not build: nothing to compare")
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for k, n in opts.shapes:
        weight = torch.randn(n, k, generator=gen) * k**-0.5  # [out, in]
        layers.append((weight, packed_gemm.pack(weight.t())))
    limit = packed_gemm.max_rows()
    results = []
    for rows in opts.rows:
        xs = [torch.randn(rows, k, generator=gen) for k, _ in opts.shapes]
        figure = _compare(rows, xs, layers, opts)
        figure["packed_by_engine"] = limit is None or rows <= limit
        say(
            f"{rows:5d} rows: packed {figure['packed_gflops']:6.1f}  F.linear "
            f"{figure['f_linear_gflops']:6.1f} GFLOP/s  ratio {figure['ratio']:.3f}"
        )
        results.append(figure)
    result: dict[str, Any] = {
        "benchmark": "gemm",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "options": {**vars(opts), "shapes": [list(s) for s in opts.shapes]},
        "panel_width": packed_gemm.panel_width(),
        "packed_max_rows": limit,
        "machine": machine(),
        "rows": results,
    }
    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gemm-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    say(f"wrote {path}")
    return result


def _compare(rows: int, xs: list[Any], layers: list[Any], opts: GemmBenchOptions) -> dict[str, Any]:
    """Paired alternating timings of both sides at one row count."""
    import torch.nn.functional as F

    from loraplex.kernels import packed_gemm

    flops_per_call = sum(2 * rows * w.shape[0] * w.shape[1] for w, _ in layers)

    def packed() -> list[Any]:
        return [packed_gemm.linear_any_rows(x, w, p) for x, (w, p) in zip(xs, layers, strict=True)]

    def reference() -> list[Any]:
        return [F.linear(x, w) for x, (w, _) in zip(xs, layers, strict=True)]

    got, want = packed(), reference()  # warm both, and compare
    if any(y is None for y in got):
        raise RuntimeError(f"the packed kernel did not take {rows} rows")
    max_diff = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    iters = opts.iters or _iters_for(reference)
    sides = {"packed": packed, "f_linear": reference}
    rates: dict[str, list[float]] = {"packed": [], "f_linear": []}
    for r in range(opts.repeats):
        order = ("packed", "f_linear") if r % 2 == 0 else ("f_linear", "packed")
        for name in order:
            start = time.perf_counter()
            for _ in range(iters):
                sides[name]()
            rates[name].append(flops_per_call * iters / (time.perf_counter() - start) / 1e9)
    ratios = [p / f for p, f in zip(rates["packed"], rates["f_linear"], strict=True)]
    return {
        "rows": rows,
        "iters": iters,
        "packed_gflops": statistics.median(rates["packed"]),
        "f_linear_gflops": statistics.median(rates["f_linear"]),
        "ratio": statistics.median(ratios),
        "packed_gflops_runs": rates["packed"],
        "f_linear_gflops_runs": rates["f_linear"],
        "max_abs_diff": max_diff,
    }


def _iters_for(side: Callable[[], object], target_s: float = 0.02) -> int:
    """Calls of ``side`` that take about ``target_s``, at least 1."""
    start = time.perf_counter()
    side()
    return max(1, round(target_s / max(time.perf_counter() - start, 1e-6)))
