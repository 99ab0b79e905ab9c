"""Benchmark output: a plain-text table, a JSON file, and a PNG plot when matplotlib exists."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any


def format_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_table(result: dict[str, Any]) -> str:
    s = result["summary"]
    lp, hf = s["loraplex"], s.get("hf")
    rows: list[tuple[str, ...]] = [("", "loraplex", "HF generate()")]
    rows.append(
        (
            "requests timed",
            str(lp["requests"]),
            f"{hf['requests']}{' (extrapolated)' if hf['extrapolated'] else ''}" if hf else "-",
        )
    )
    per_repeat = "per-repeat tok/s"
    rows.append(
        (
            per_repeat,
            " ".join(f"{v:.1f}" for v in lp["per_repeat_tokens_per_s"]),
            " ".join(f"{v:.1f}" for v in hf["per_repeat_tokens_per_s"]) if hf else "-",
        )
    )
    rows.append(
        (
            "median output tok/s",
            f"{lp['median_tokens_per_s']:.1f}",
            f"{hf['median_tokens_per_s']:.1f}" if hf else "-",
        )
    )
    rows.append(
        (
            "achieved GFLOP/s",
            f"{lp['median_gflops']:.2f}",
            f"{hf['median_gflops']:.2f}" if hf else "-",
        )
    )
    rows.append(
        (
            f"MFU (peak {s['peak_gflops']:.1f} GFLOP/s)",
            f"{lp['mfu'] * 100:.2f}%",
            f"{hf['mfu'] * 100:.2f}%" if hf else "-",
        )
    )
    rows.append(
        (
            "prefix-cache hit tokens",
            " ".join(str(v) for v in lp["prefix_cache_hit_tokens"]),
            "-",
        )
    )
    rows.append(("preemptions", " ".join(str(v) for v in lp["preemptions"]), "-"))
    text = format_table(rows)
    if s.get("speedup") is not None:
        text += f"\n\nloraplex / HF throughput (ratio of medians): {s['speedup']:.2f}x"
        paired = " ".join(f"{v:.2f}x" for v in s["per_repeat_speedup"])
        text += f"; per repeat pair: {paired} (median {s['median_paired_speedup']:.2f}x)"
    return text


def prefix_table(pc: dict[str, Any]) -> str:
    on, off = pc["caching_on"], pc["caching_off"]
    hits = [r["hit_tokens"] for r in on["runs"]]
    computed = [r["computed_prompt_tokens"] for r in on["runs"]]
    rows: list[tuple[str, ...]] = [
        ("prefix caching", "median TTFT ms", "hit tokens", "computed prompt tokens"),
        ("on", f"{on['median_ttft_s'] * 1e3:.1f}", str(hits[0]), str(computed[0])),
        (
            "off",
            f"{off['median_ttft_s'] * 1e3:.1f}",
            str(off["runs"][0]["hit_tokens"]),
            str(off["runs"][0]["computed_prompt_tokens"]),
        ),
    ]
    ratio = pc["ttft_ratio_off_over_on"]
    return (
        format_table(rows)
        + f"\n\nTTFT off / on (ratio of medians, shared {pc['prefix_len']}-token prefix): "
        + (f"{ratio:.2f}x" if ratio is not None else "n/a")
        + f"; only unshared tokens computed: {pc['only_unshared_computed']}"
    )


def write_json(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")


def write_plot(result: dict[str, Any], path: Path) -> str | None:
    """Write the PNG and return None, or return why no plot was written."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed; plot skipped (pip install 'loraplex[bench]')"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    systems = [("loraplex", s["loraplex"])] + ([("HF generate()", s["hf"])] if s.get("hf") else [])
    panels = 2 if result.get("prefix_cache_test") else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    ax = axes[0][0]
    for x, (name, data) in enumerate(systems):
        ax.bar(x, data["median_tokens_per_s"], color="C0" if x == 0 else "C1", label=name)
        ax.scatter(
            [x] * len(data["per_repeat_tokens_per_s"]),
            data["per_repeat_tokens_per_s"],
            color="k",
            s=12,
            zorder=3,
        )
    ax.set_xticks(range(len(systems)), [n for n, _ in systems])
    ax.set_ylabel("output tokens/s (median, dots = repeats)")
    ax.set_title("throughput" + (f" — {s['speedup']:.2f}x" if s.get("speedup") else ""))
    if panels == 2:
        pc = result["prefix_cache_test"]
        ax2 = axes[0][1]
        values = [pc["caching_on"]["median_ttft_s"] * 1e3, pc["caching_off"]["median_ttft_s"] * 1e3]
        ax2.bar([0, 1], values, color=["C2", "C3"])
        ax2.set_xticks([0, 1], ["prefix cache on", "off"])
        ax2.set_ylabel("time to first token, ms (median)")
        ax2.set_title(f"shared {pc['prefix_len']}-token prefix")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


MULTI_LORA_COLUMNS = (
    ("loraplex", "loraplex+LoRA"),
    ("loraplex_base", "loraplex base"),
    ("peft_static", "PEFT per-adapter"),
    ("peft_mixed", "PEFT mixed"),
)


def multi_lora_table(result: dict[str, Any]) -> str:
    """The four systems side by side, then the two headline ratios and the engine's LoRA stats."""
    s = result["summary"]
    per = s["systems"]
    cols = [(key, title) for key, title in MULTI_LORA_COLUMNS if key in per]

    def row(label: str, cell: Any) -> tuple[str, ...]:
        return (label, *(cell(per[key]) for key, _ in cols))

    def lora_only(key: str) -> Any:
        return lambda d: " ".join(str(v) for v in d[key]) if key in d else "-"

    rows: list[tuple[str, ...]] = [("", *(title for _, title in cols))]
    rows.append(
        row("requests timed", lambda d: f"{d['requests']}{'*' if d['extrapolated'] else ''}")
    )
    rows.append(
        row(
            "per-repeat tok/s", lambda d: " ".join(f"{v:.1f}" for v in d["per_repeat_tokens_per_s"])
        )
    )
    rows.append(row("median output tok/s", lambda d: f"{d['median_tokens_per_s']:.1f}"))
    rows.append(row("achieved GFLOP/s", lambda d: f"{d['median_gflops']:.2f}"))
    rows.append(
        row(f"MFU (peak {s['peak_gflops']:.1f} GFLOP/s)", lambda d: f"{d['mfu'] * 100:.2f}%")
    )
    rows.append(row("LoRA slot loads", lora_only("lora_slot_loads")))
    rows.append(row("preemptions", lora_only("preemptions")))
    text = format_table(rows)
    if any(d["extrapolated"] for d in per.values()):
        text += "\n* a subset of whole batches; tokens/s taken as the full workload's rate"
    a = result["adapters"]
    text += (
        f"\n\n{a['num_adapters']} rank-{_ranks(a['rank'])} adapters ({a['distribution']}), "
        f"requests per adapter {a['requests_per_adapter']}"
    )
    if s.get("speedup_vs_best_peft") is not None:
        paired = " ".join(f"{v:.2f}x" for v in s["per_repeat_speedup_vs_best_peft"])
        text += (
            f"\nloraplex / best PEFT ({s['best_peft']}): {s['speedup_vs_best_peft']:.2f}x "
            f"(target >= {s['targets']['speedup_vs_best_peft']:g}x); per repeat pair: {paired} "
            f"(median {s['median_paired_speedup_vs_best_peft']:.2f}x)"
        )
    if s.get("lora_with_over_without") is not None:
        paired = " ".join(f"{v:.3f}" for v in s["per_repeat_lora_with_over_without"])
        text += (
            f"\nloraplex with / without adapters: {s['lora_with_over_without']:.3f} "
            f"(target >= {s['targets']['lora_with_over_without']:g}); per repeat pair: {paired} "
            f"(median {s['median_paired_lora_with_over_without']:.3f})"
        )
    stats = result.get("engine_lora_stats") or {}
    if stats:
        text += "\nengine LoRA stats: " + ", ".join(f"{k}={v}" for k, v in stats.items())
    return text


def _ranks(rank: int | list[int]) -> str:
    return "/".join(map(str, rank)) if isinstance(rank, list) else str(rank)


def write_multi_lora_plot(result: dict[str, Any], path: Path) -> str | None:
    """The four systems' median tokens/s (dots: repeats); None, or why no plot was written."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed; plot skipped (pip install 'loraplex[bench]')"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    cols = [(k, t) for k, t in MULTI_LORA_COLUMNS if k in s["systems"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for x, (key, _) in enumerate(cols):
        data = s["systems"][key]
        ax.bar(x, data["median_tokens_per_s"], color=f"C{x}")
        reps = data["per_repeat_tokens_per_s"]
        ax.scatter([x] * len(reps), reps, color="k", s=12, zorder=3)
    ax.set_xticks(range(len(cols)), [t for _, t in cols])
    ax.set_ylabel("output tokens/s (median, dots = repeats)")
    a = result["adapters"]
    title = f"{a['num_adapters']} adapters, {a['distribution']}"
    if s.get("speedup_vs_best_peft") is not None:
        title += f" — {s['speedup_vs_best_peft']:.2f}x best PEFT"
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
