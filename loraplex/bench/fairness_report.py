"""The fairness benchmark's numbers and pictures: percentiles, each tenant's tokens in a window
and over time, the summary over repeats (medians, fair-over-fcfs ratios per repeat pair, the
issue's targets), the table, and the PNG (each tenant's share over time in the shares scenario,
tenant B's time to first token over time in the flood, one line per policy)."""

from __future__ import annotations

import importlib.util
import itertools
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.bench.report import format_table

if TYPE_CHECKING:
    from loraplex.bench.http_load import StreamRecord

TARGETS: dict[str, Any] = {  # the acceptance figures
    "b_p99_ttft_fair_over_fcfs_max": 0.25,
    "throughput_fair_over_fcfs_min": 0.9,
    "equal_share_range": (0.42, 0.58),
    "weighted_share_range": (0.68, 0.82),
}
BUCKET_S = 5.0  # the time series' resolution


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0–100), linear between the closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def tokens_by_tenant(records: Sequence[StreamRecord], start: float, end: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in records:
        out[r.tenant] = out.get(r.tenant, 0.0) + r.tokens_between(start, end)
    return out


def shares(tokens: dict[str, float]) -> dict[str, float]:
    total = sum(tokens.values())
    return {t: (n / total if total else 0.0) for t, n in sorted(tokens.items())}


def series(records: Sequence[StreamRecord], t0: float, end: float) -> dict[str, Any]:
    """Tokens per tenant in ``BUCKET_S`` buckets from ``t0`` (the plot's share over time)."""
    edges = [t0 + i * BUCKET_S for i in range(int((end - t0) // BUCKET_S) + 1)]
    per: dict[str, list[float]] = {}
    for i, (a, b) in enumerate(itertools.pairwise(edges)):
        for tenant, n in tokens_by_tenant(records, a, b).items():
            per.setdefault(tenant, [0.0] * (len(edges) - 1))[i] = round(n, 1)
    return {"bucket_s": BUCKET_S, "t": [round(e - t0, 1) for e in edges[:-1]], "tokens": per}


def ttft_summary(records: Sequence[StreamRecord]) -> dict[str, Any]:
    ttfts = [r.ttft for r in records if r.ttft is not None]
    return {
        "n": len(ttfts),
        "p50_s": round_or_none(percentile(ttfts, 50)),
        "p99_s": round_or_none(percentile(ttfts, 99)),
        "max_s": round_or_none(max(ttfts, default=None)),
    }


def round_or_none(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def summarize(runs: list[dict[str, Any]], policies: Sequence[str], repeats: int) -> dict[str, Any]:
    """Medians per policy over the repeats, and fair-over-fcfs ratios per repeat pair."""

    def med(values: list[float | None]) -> float | None:
        kept = [v for v in values if v is not None]
        return round(statistics.median(kept), 4) if kept else None

    per: dict[str, Any] = {}
    for policy in policies:
        mine = [r["result"] for r in runs if r["policy"] == policy]
        per[policy] = {
            "b_p99_ttft_s": med([m["flood"]["b_ttft"]["p99_s"] for m in mine]),
            "output_tokens_per_s": med([m["flood"]["output_tokens_per_s"] for m in mine]),
            "equal_share_a": med([m["shares"]["equal"]["shares"].get("a") for m in mine]),
            "weighted_share_a": med([m["shares"]["weighted"]["shares"].get("a") for m in mine]),
            "urgent_ttft_p50_s": med([m["priority"]["urgent_ttft_p50_s"] for m in mine]),
            "admitted_before_all_queued": [
                m["priority"]["admitted_before_all_queued"] for m in mine
            ],
        }
    summary: dict[str, Any] = {"policies": per, "targets": TARGETS}
    if {"fair", "fcfs"} <= set(policies):
        pairs = [
            (
                next(r["result"] for r in runs if r["repeat"] == i and r["policy"] == "fair"),
                next(r["result"] for r in runs if r["repeat"] == i and r["policy"] == "fcfs"),
            )
            for i in range(repeats)
        ]
        ttft = [f["flood"]["b_ttft"]["p99_s"] / c["flood"]["b_ttft"]["p99_s"] for f, c in pairs]
        tput = [
            f["flood"]["output_tokens_per_s"] / c["flood"]["output_tokens_per_s"] for f, c in pairs
        ]
        fair = per["fair"]
        low_e, high_e = TARGETS["equal_share_range"]
        low_w, high_w = TARGETS["weighted_share_range"]
        summary |= {
            "b_p99_ttft_fair_over_fcfs": [round(v, 4) for v in ttft],
            "median_b_p99_ttft_fair_over_fcfs": med(list(ttft)),
            "throughput_fair_over_fcfs": [round(v, 4) for v in tput],
            "median_throughput_fair_over_fcfs": med(list(tput)),
            "met": {
                "flood_ttft": (med(list(ttft)) or 1) <= TARGETS["b_p99_ttft_fair_over_fcfs_max"],
                "flood_throughput": (med(list(tput)) or 0)
                >= TARGETS["throughput_fair_over_fcfs_min"],
                "equal_shares": low_e <= (fair["equal_share_a"] or 0) <= high_e,
                "weighted_shares": low_w <= (fair["weighted_share_a"] or 0) <= high_w,
            },
        }
    return summary


def fairness_table(summary: dict[str, Any]) -> str:
    per = summary["policies"]
    rows: list[tuple[str, ...]] = [("", *per)]
    labels = (
        ("flood: B p99 TTFT (s)", "b_p99_ttft_s"),
        ("flood: output tok/s", "output_tokens_per_s"),
        ("shares, equal weights: A", "equal_share_a"),
        ("shares, A weight 3: A", "weighted_share_a"),
        ("priority -1: TTFT p50 (s)", "urgent_ttft_p50_s"),
        ("priority -1: admitted first", "admitted_before_all_queued"),
    )
    for label, key in labels:
        rows.append((label, *(str(per[p][key]) for p in per)))
    text = format_table(rows)
    if "median_b_p99_ttft_fair_over_fcfs" in summary:
        text += (
            f"\nfair/fcfs B p99 TTFT: {summary['median_b_p99_ttft_fair_over_fcfs']} (per pair "
            f"{summary['b_p99_ttft_fair_over_fcfs']}; target <= 0.25)\nfair/fcfs throughput: "
            f"{summary['median_throughput_fair_over_fcfs']} (per pair "
            f"{summary['throughput_fair_over_fcfs']}; target >= 0.9)\nmet: {summary['met']}"
        )
    return text


def write_fairness_plot(result: dict[str, Any], path: Path) -> str | None:
    """None, or why no plot was written. Plots each policy's first repeat."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed; plot skipped (pip install 'loraplex[bench]')"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    firsts: dict[str, dict[str, Any]] = {}
    for run in result["runs"]:
        firsts.setdefault(run["policy"], run["result"])
    fig, (shares, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n, (policy, res) in enumerate(firsts.items()):
        s = res["shares"]["series"]
        a, b = s["tokens"].get("a", []), s["tokens"].get("b", [])
        share = [x / (x + y) if x + y else None for x, y in zip(a, b, strict=False)]
        shares.plot(s["t"][: len(share)], share, color=f"C{n}", label=f"{policy}: A's share")
        shares.axvline(res["shares"]["weight_changed_at_s"], color=f"C{n}", ls=":", lw=1)
        points = [(t, v) for t, v in res["flood"]["b_ttft_over_time"] if v is not None]
        ttft.plot([t for t, _ in points], [v for _, v in points], "o-", color=f"C{n}", ms=3,
                  label=policy)  # fmt: skip
    shares.axhline(0.5, color="grey", lw=0.8)
    shares.axhline(0.75, color="grey", lw=0.8, ls="--")
    shares.set_ylim(0, 1)
    shares.set_xlabel("s since the load started (dotted: A's weight 1 -> 3)")
    shares.set_ylabel("tenant A's share of generated tokens (B: 1 - A)")
    shares.set_title("A and B both backlogged")
    shares.legend()
    ttft.set_yscale("log")
    ttft.set_xlabel("s since A's flood started")
    ttft.set_ylabel("tenant B's time to first token, s")
    ttft.set_title("A floods, B sends one request every few seconds")
    ttft.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
