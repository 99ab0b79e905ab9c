"""``python -m benchmarks.gemm``: the packed CPU GEMM (``kernels/packed_gemm``) against ``F.linear``
(torch's BLAS, MKL on x86) per row count, on a model's linear shapes.

The measurement behind ``packed_gemm.max_rows()`` and ``bf16_max_rows()``: up to which batch
size the engine's linears should take the packed kernels. For each ``--rows`` value,
``--repeats`` rounds run every side in turn, the order rotated and reversed from round to round
(two sides: they alternate which goes first); each side runs every shape (SmolLM2-135M's fused
q|k|v, o, gate|up and down projections by default) ``--iters`` times, and the figure is
GFLOP/s over all of them. The weights are warm in cache, or with ``--weight-copies N`` each shape
is held N times over and the calls cycle through the copies, so that the weights come from
memory as a whole model's do (batch-1 decode is then bound by reading them). The sides: the packed fp32 kernel and fp32 ``F.linear``,
and where the CPU has the bf16 kernel (``packed_gemm.bf16_supported()``) also the packed bf16
kernel (fp32 x and y, x rounded on the fly) and ``F.linear`` on bf16 x and weight (torch's
bf16 GEMM alone, oneDNN on x86: x converted before the timing, its bf16 y left as is). Reports
per row count the median of each side, the medians of the paired ratios, the largest
difference of each packed result from its reference (fp32: ``F.linear``; bf16:
``F.linear(x.bfloat16().float(), w.bfloat16().float())``), and whether this build routes that
row count to each packed kernel. Writes ``gemm-<time>.json`` to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Mapping
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
    weight_copies: int = 1  # copies of every shape, cycled through: > 1 reads weights cold
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
    p.add_argument(
        "--weight-copies",
        type=positive_int,
        default=1,
        metavar="N",
        help="hold each shape N times and cycle through them, so that the weights come from "
        "memory rather than cache (default 1: warm)",
    )
    p.add_argument("--output-dir", default="bench-results")


def options_from(args: argparse.Namespace) -> GemmBenchOptions:
    return GemmBenchOptions(
        rows=args.rows,
        shapes=args.shapes,
        repeats=args.repeats,
        iters=args.iters or 0,
        threads=args.threads,
        weight_copies=args.weight_copies,
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
    bf16 = packed_gemm.bf16_supported()
    gen = torch.Generator().manual_seed(0)
    layers = []
    shapes = [shape for _ in range(opts.weight_copies) for shape in opts.shapes]
    for k, n in shapes:
        weight = torch.randn(n, k, generator=gen) * k**-0.5  # [out, in]
        packed_bf16 = packed_gemm.pack(weight.t(), torch.bfloat16) if bf16 else None
        layers.append(Layer(weight, packed_gemm.pack(weight.t()), packed_bf16))
    limit, bf16_limit = packed_gemm.max_rows(), packed_gemm.bf16_max_rows()
    results = []
    for rows in opts.rows:
        xs = [torch.randn(rows, k, generator=gen) for k, _ in opts.shapes]
        figure = _compare(rows, xs * opts.weight_copies, layers, opts)
        figure["packed_by_engine"] = limit is None or rows <= limit
        figure["bf16_packed_by_engine"] = (
            (bf16_limit is None or rows <= bf16_limit) if bf16 else None
        )
        say(_line(figure))
        results.append(figure)
    result: dict[str, Any] = {
        "benchmark": "gemm",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "options": {**vars(opts), "shapes": [list(s) for s in opts.shapes]},
        "panel_width": packed_gemm.panel_width(),
        "packed_max_rows": limit,
        "bf16": bf16,
        "bf16_max_rows": bf16_limit if bf16 else None,
        "cpu": _cpu_model(),
        "machine": machine(),
        "rows": results,
    }
    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gemm-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    say(f"wrote {path}")
    return result


@dataclass(frozen=True)
class Layer:
    weight: Any  # [out, in] fp32
    packed: Any  # packed_gemm.pack(weight.t())
    packed_bf16: Any  # packed_gemm.pack(weight.t(), torch.bfloat16), None without the kernel


def _compare(
    rows: int, xs: list[Any], layers: list[Layer], opts: GemmBenchOptions
) -> dict[str, Any]:
    """Paired timings of every side at one row count, the order rotated between rounds."""
    import torch.nn.functional as F

    from loraplex.kernels import packed_gemm

    flops_per_call = sum(
        2 * rows * layer.weight.shape[0] * layer.weight.shape[1] for layer in layers
    )
    bf16 = all(layer.packed_bf16 is not None for layer in layers)
    xs_bf16 = [x.bfloat16() for x in xs]
    weights_bf16 = [layer.weight.bfloat16() for layer in layers]

    pairs = list(zip(xs, layers, strict=True))

    def packed() -> list[Any]:
        return [packed_gemm.linear_any_rows(x, ly.weight, ly.packed) for x, ly in pairs]

    def reference() -> list[Any]:
        return [F.linear(x, ly.weight) for x, ly in pairs]

    def packed_bf16() -> list[Any]:
        return [packed_gemm.linear_any_rows(x, ly.weight, ly.packed_bf16) for x, ly in pairs]

    def reference_bf16() -> list[Any]:
        return [F.linear(x, w) for x, w in zip(xs_bf16, weights_bf16, strict=True)]

    got, want = packed(), reference()  # warm both, and compare
    if any(y is None for y in got):
        raise RuntimeError(f"the packed kernel did not take {rows} rows")
    max_diff = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    sides: dict[str, Callable[[], list[Any]]] = {"packed": packed, "f_linear": reference}
    bf16_diff = None
    if bf16:
        got = packed_bf16()
        reference_bf16()
        if any(y is None for y in got):
            raise RuntimeError(f"the packed bf16 kernel did not take {rows} rows")
        exact = [
            F.linear(x.bfloat16().float(), w.float()) for x, w in zip(xs, weights_bf16, strict=True)
        ]
        bf16_diff = max(float((a - b).abs().max()) for a, b in zip(got, exact, strict=True))
        sides |= {"packed_bf16": packed_bf16, "f_linear_bf16": reference_bf16}
    iters = opts.iters or _iters_for(reference)
    rates = _rounds(sides, iters, flops_per_call, opts.repeats)
    figure: dict[str, Any] = {
        "rows": rows,
        "iters": iters,
        "packed_gflops": statistics.median(rates["packed"]),
        "f_linear_gflops": statistics.median(rates["f_linear"]),
        "ratio": _paired(rates["packed"], rates["f_linear"]),
        "packed_gflops_runs": rates["packed"],
        "f_linear_gflops_runs": rates["f_linear"],
        "max_abs_diff": max_diff,
    }
    none: dict[str, Any] = {
        "packed_bf16_gflops": None, "f_linear_bf16_gflops": None,
        "bf16_over_packed": None, "bf16_over_f_linear_bf16": None, "bf16_over_best_f_linear": None,
        "packed_bf16_gflops_runs": None, "f_linear_bf16_gflops_runs": None,
        "bf16_max_abs_diff": None,
    }  # fmt: skip
    if not bf16:
        return figure | none
    best = [max(f, b) for f, b in zip(rates["f_linear"], rates["f_linear_bf16"], strict=True)]
    return figure | {
        "packed_bf16_gflops": statistics.median(rates["packed_bf16"]),
        "f_linear_bf16_gflops": statistics.median(rates["f_linear_bf16"]),
        "bf16_over_packed": _paired(rates["packed_bf16"], rates["packed"]),
        "bf16_over_f_linear_bf16": _paired(rates["packed_bf16"], rates["f_linear_bf16"]),
        "bf16_over_best_f_linear": _paired(rates["packed_bf16"], best),
        "packed_bf16_gflops_runs": rates["packed_bf16"],
        "f_linear_bf16_gflops_runs": rates["f_linear_bf16"],
        "bf16_max_abs_diff": bf16_diff,
    }


def _rounds(
    sides: Mapping[str, Callable[[], object]], iters: int, flops_per_call: int, repeats: int
) -> dict[str, list[float]]:
    """GFLOP/s of each side in each of ``repeats`` rounds; round r runs the sides rotated by r
    and, on odd rounds, reversed, so that no side always follows the same one."""
    names = list(sides)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order[::-1] if r % 2 else order:
            start = time.perf_counter()
            for _ in range(iters):
                sides[name]()
            rates[name].append(flops_per_call * iters / (time.perf_counter() - start) / 1e9)
    return rates


def _paired(a: list[float], b: list[float]) -> float:
    """The median of the paired ratios a / b (one pair per round)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _line(figure: dict[str, Any]) -> str:
    line = (
        f"{figure['rows']:5d} rows: packed {figure['packed_gflops']:6.1f}  F.linear "
        f"{figure['f_linear_gflops']:6.1f} GFLOP/s  ratio {figure['ratio']:.3f}"
    )
    if figure["packed_bf16_gflops"] is None:
        return line
    return line + (
        f" | bf16: packed {figure['packed_bf16_gflops']:6.1f}  F.linear "
        f"{figure['f_linear_bf16_gflops']:6.1f}  over packed fp32 "
        f"{figure['bf16_over_packed']:.2f}  over the best F.linear "
        f"{figure['bf16_over_best_f_linear']:.2f}"
    )


def _cpu_model() -> str:
    """The CPU's model name with its family and model numbers (``/proc/cpuinfo``: a VM may name
    only the vendor's line, e.g. AMD EPYC; family 25 model 17 is Zen 4), or the platform's
    processor string."""
    import platform

    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def _iters_for(side: Callable[[], object], target_s: float = 0.02) -> int:
    """Calls of ``side`` that take about ``target_s``, at least 1."""
    start = time.perf_counter()
    side()
    return max(1, round(target_s / max(time.perf_counter() - start, 1e-6)))


DESCRIPTION = (
    "Time the native packed GEMM against F.linear (torch's BLAS) at each --rows batch size on "
    "SmolLM2-135M's linear shapes (or --shapes), weights warm, in paired alternating runs "
    "(median): the measurement behind the row count up to which the engine uses the packed "
    "kernel. Writes JSON to --output-dir."
)


def _main_run(args: argparse.Namespace) -> int:
    run_gemm(options_from(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import run_main

    return run_main("gemm", DESCRIPTION, add_gemm_arguments, _main_run, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
