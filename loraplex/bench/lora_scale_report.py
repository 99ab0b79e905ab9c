"""The adapters-at-scale sweep's output: a Markdown table (one row per N) and a PNG of the
with/without-adapters ratio against N (the shape of S-LoRA's Table 3), when matplotlib exists."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

COLUMNS = (
    "N",
    "tok/s with",
    "tok/s base",
    "ratio",
    "paired",
    "target",
    "pool MB",
    "used MB",
    "real MB",
    "used/real",
    "loads",
    "evictions",
    "load waits",
    "failed",
    "adapter/base bytes",
    "bandwidth bound",
)


def _cell(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _mb(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.3f}"


def markdown(result: dict[str, Any]) -> str:
    """The table, then one line on the adapters and one on what the bound columns mean."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    for row in result["table"]:
        cells = [
            str(row["num_adapters"]),
            _cell(row["tokens_per_s_with"], "{:.1f}"),
            _cell(row["tokens_per_s_base"], "{:.1f}"),
            _cell(row["ratio"], "{:.3f}"),
            _cell(row["median_paired_ratio"], "{:.3f}"),
            _cell(row["target"], "≥ {:g}"),
            _mb(row["pool_mb"]),
            _mb(row["pool_used_mb"]),
            _mb(row["adapter_mb"]),
            _cell(row["used_over_real"], "{:.3f}"),
            str(row["slot_loads"]),
            str(row["slot_evictions"]),
            str(row["load_waits"]),
            str(row["failures"]),
            _cell(row["adapter_over_base_bytes_mean"], "{:.2f}"),
            _cell(row["ratio_if_bandwidth_bound"], "{:.3f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    a = result["adapters"]
    alpha = f", alpha {a['powerlaw_alpha']:g}" if a["distribution"] == "powerlaw" else ""
    lines += [
        "",
        f"{a['registered']} adapters registered, rank {'/'.join(map(str, a['rank_cycle']))}, on "
        f"{len(a['target_modules'])} projections, requests {a['distribution']}{alpha}; "
        f"{result['workload']['num_requests']} requests, {result['options']['repeats']} "
        f"alternating repeats; {result['pool_rule']}.",
        "ratio: median tok/s with adapters / without; paired: median of the per-repeat ratios; "
        "loads, evictions, load waits: pool copies, pool evictions and steps that waited on a "
        "copy during the timed runs with adapters; used/real: pool bytes used / the resident "
        "adapters' real bytes; adapter/base bytes: weight bytes a decode step reads for its "
        "distinct adapters over the base model's (mean over steps); bandwidth bound: the ratio "
        "if every step were bound by weight bytes read.",
    ]
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: Path) -> str | None:
    """Ratio against N (log x), dots for the paired per-repeat ratios, targets as crosses; None,
    or why no plot was written."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed; plot skipped (pip install 'loraplex[bench]')"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in result["points"] if p["summary"]["ratio"] is not None]
    if not points:
        return "no ratio to plot (loraplex_base was not run)"
    ns = [p["num_adapters"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ns, [p["summary"]["ratio"] for p in points], "o-", color="C0", label="measured")
    for p in points:
        paired = p["summary"]["per_repeat_ratio"]
        ax.scatter([p["num_adapters"]] * len(paired), paired, color="k", s=10, zorder=3)
    bound = [p["weight_traffic"]["ratio_if_bandwidth_bound"] for p in points]
    ax.plot(ns, bound, ":", color="C2", label="if bound by weight bytes read")
    targets = [(p["num_adapters"], p["summary"]["target"]) for p in points]
    shown = [(n, t) for n, t in targets if t is not None]
    if shown:
        xs, ys = [n for n, _ in shown], [t for _, t in shown]
        ax.scatter(xs, ys, marker="x", color="C3", s=40, label="issue 15 target")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_ylim(0, 1.1)
    dist = result["adapters"]["distribution"]
    how = "request i uses adapter i % N" if dist == "roundrobin" else f"{dist} over N"
    ax.set_xlabel(f"adapters N ({how})")
    ax.set_ylabel("tokens/s with adapters / without")
    ax.set_title("loraplex: throughput with N adapters over the base model")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
