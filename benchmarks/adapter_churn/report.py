"""The adapter-churn benchmark's numbers and picture: each request's outcome, B's time to first
token per phase, errors per tenant, engine counter deltas, issue 30's acceptance checks, the
table, and the PNG (B's TTFT over time in each phase; the churn phase's adapter loads,
evictions, deferrals and engine restarts over time)."""

from __future__ import annotations

import importlib.util
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.bench.fairness_report import percentile, round_or_none
from loraplex.bench.http_load import StreamRecord
from loraplex.bench.report import format_table

TARGETS: dict[str, float] = {  # issue 30's acceptance figures
    "b_p90_churn_over_baseline_max": 2.0,
    "cold_extra_ttft_max_s": 1.0,
}
FIRST_ERRORS = 5  # distinct errors kept per tenant and phase
PLOTTED = ("num_steps", "slot_loads", "slot_evictions", "loads_deferred", "disk_loads")


@dataclass(frozen=True)
class Sent:
    """One streamed request and what it asked for: it completed when it made all its tokens."""

    record: StreamRecord
    model: str
    max_tokens: int

    @property
    def ok(self) -> bool:
        r = self.record
        return r.status == 200 and r.error is None and r.tokens == self.max_tokens

    def problem(self) -> dict[str, Any]:
        """The failure as the report shows it (status, code, message)."""
        r = self.record
        message = r.error or f"the stream ended after {r.tokens} of {self.max_tokens} tokens"
        code = r.error_code or (f"http_{r.status}" if r.status != 200 else "incomplete_stream")
        return {"model": self.model, "status": r.status, "code": code, "message": message[:300]}


def ttft_summary(sent: Sequence[Sent]) -> dict[str, Any]:
    """p50/p90/p99 of the completed requests' time to first token (seconds), and counts."""
    ttfts = [s.record.ttft for s in sent if s.ok and s.record.ttft is not None]
    return {
        "n": len(ttfts),  # completed with a first text chunk: the percentiles' samples
        "completed": sum(s.ok for s in sent),
        "sent": len(sent),
        "p50_s": round_or_none(percentile(ttfts, 50)),
        "p90_s": round_or_none(percentile(ttfts, 90)),
        "p99_s": round_or_none(percentile(ttfts, 99)),
        "max_s": round_or_none(max(ttfts, default=None)),
    }


def error_summary(sent: Sequence[Sent]) -> dict[str, Any]:
    """The failures: their count, per code, and the first ``FIRST_ERRORS`` distinct ones
    (status, code and message) with how often each came."""
    failed = [s.problem() for s in sent if not s.ok]
    distinct: dict[tuple[int, str, str], dict[str, Any]] = {}
    for p in failed:
        seen = distinct.setdefault((p["status"], p["code"], p["message"]), p | {"count": 0})
        seen["count"] += 1
    return {
        "count": len(failed),
        "by_code": dict(Counter(p["code"] for p in failed).most_common()),
        "first": list(distinct.values())[:FIRST_ERRORS],
    }


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """``after - before`` per counter (None where the server did not report it)."""
    keys = sorted((before.keys() | after.keys()) - {"healthy"})
    return {k: _number(after[k] - before[k]) if k in before and k in after else None for k in keys}


def _number(value: float) -> float:
    """An int where the value is whole (counters), else rounded."""
    return int(value) if float(value).is_integer() else round(value, 3)


def summarize(cold: dict[str, Any], phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 30's acceptance, measured: no restarts or errors in any phase, every A request
    completed, B's p90 under churn against the one-adapter baseline, deferrals against steps in
    the churn phase, and the cold load's extra time to first token."""

    def p90(name: str) -> float | None:
        value = phases.get(name, {}).get("b_ttft", {}).get("p90_s")
        return float(value) if value is not None else None

    churn = phases.get("churn", {})
    engine = churn.get("engine", {})
    ratio = None
    if (c := p90("churn")) is not None and (b := p90("baseline")):
        ratio = round(c / b, 3)
    restarts = sum(p["engine"].get("engine_restarts") or 0 for p in phases.values())
    errors = {t: sum(p["errors"][t]["count"] for p in phases.values()) for t in ("a", "b")}
    for t in errors:  # the cold phase's requests (its warm-ups included)
        errors[t] += cold.get("errors", {}).get(t, {}).get("count", 0)
    a_failed = sum(p["a"]["failed"] for p in phases.values())
    deferred, steps = engine.get("loads_deferred"), engine.get("num_steps")
    extra = cold.get("extra_ttft_s")
    return {
        "b_p90_ttft_s": {name: p90(name) for name in phases},
        "b_p90_churn_over_baseline": ratio,
        "engine_restarts": restarts,
        "errors": errors,
        "a_requests_failed": a_failed,
        "churn_loads_deferred": deferred,
        "churn_num_steps": steps,
        "cold_extra_ttft_s": extra,
        "targets": TARGETS,
        "met": {
            "no_engine_restarts": restarts == 0,
            "no_errors": errors == {"a": 0, "b": 0},
            "every_a_request_completed": a_failed == 0,
            "b_p90_churn_over_baseline": ratio is not None
            and ratio <= TARGETS["b_p90_churn_over_baseline_max"],
            "loads_deferred_at_most_steps": deferred is not None
            and steps is not None
            and deferred <= steps,
            "cold_load": extra is not None and extra <= TARGETS["cold_extra_ttft_max_s"],
        },
    }


def median_or_none(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def churn_table(result: dict[str, Any]) -> str:
    phases = result["phases"]
    rows: list[tuple[str, ...]] = [("", *phases)]

    def row(label: str, get: Any) -> None:
        rows.append((label, *(str(get(p)) for p in phases.values())))

    row("B TTFT p50 (s)", lambda p: p["b_ttft"]["p50_s"])
    row("B TTFT p90 (s)", lambda p: p["b_ttft"]["p90_s"])
    row("B TTFT p99 (s)", lambda p: p["b_ttft"]["p99_s"])
    row("B server queue mean (s)", lambda p: p.get("b_server", {}).get("queue_mean_s"))
    row("B server TTFT mean (s)", lambda p: p.get("b_server", {}).get("ttft_mean_s"))
    row("B completed / sent", lambda p: f"{p['b_ttft']['completed']}/{p['b_ttft']['sent']}")
    row("A completed / sent", lambda p: f"{p['a']['completed']}/{p['a']['sent']}")
    row("A output tok/s", lambda p: p["a"]["output_tokens_per_s"])
    row("errors A / B", lambda p: f"{p['errors']['a']['count']}/{p['errors']['b']['count']}")
    for key in ("engine_restarts", "num_steps", "slot_loads", "slot_evictions", "loads_deferred",
                "disk_loads"):  # fmt: skip
        row(key, lambda p, k=key: p["engine"].get(k))
    s, cold = result["summary"], result["cold_load"]
    return (
        format_table(rows)
        + f"\ncold load: first TTFT {cold.get('cold_ttft_s')} s, warm {cold.get('warm_ttft_s')}"
        f" s, extra {cold.get('extra_ttft_s')} s ({cold.get('weights_bytes')} bytes)"
        f"\nB p90 churn/baseline: {s['b_p90_churn_over_baseline']} (target <= 2)"
        f"\nmet: {s['met']}"
    )


def write_churn_plot(result: dict[str, Any], path: Path) -> str | None:
    """None, or why no plot was written."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed; plot skipped (pip install 'loraplex[bench]')"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft, counts) = plt.subplots(1, 2, figsize=(12, 4.5))
    for n, (name, phase) in enumerate(result["phases"].items()):
        points = phase["b_ttft_over_time"]  # [sent at, TTFT or None, completed]
        done = [(t, v) for t, v, _ in points if v is not None]
        failed = [t for t, _, ok in points if not ok]
        ttft.plot([t for t, _ in done], [v for _, v in done], "o-", color=f"C{n}", ms=3,
                  label=f"{name} (p90 {phase['b_ttft']['p90_s']} s)")  # fmt: skip
        if failed:
            top = max((v for _, v in done), default=1.0)
            ttft.plot(failed, [top] * len(failed), "x", color=f"C{n}", ms=7,
                      label=f"{name}: failed")  # fmt: skip
    ttft.set_yscale("log")
    ttft.set_xlabel("s since B's window opened")
    ttft.set_ylabel("tenant B's time to first token, s")
    ttft.set_title("B alone, beside A on one adapter, beside A's churn")
    ttft.legend(fontsize=8)
    churn = result["phases"].get("churn")
    if churn is not None:
        series = churn["counters_over_time"]
        for n, key in enumerate(PLOTTED):
            counts.plot(series["t"], series[key], color=f"C{n}", label=key)
        restarts = series["engine_restarts"]
        for i in range(1, len(restarts)):
            if restarts[i] > restarts[i - 1]:
                counts.axvline(series["t"][i], color="red", lw=0.8, ls=":")
        counts.set_yscale("symlog")  # linear near 0, log above: steps and deferrals differ 100x
        counts.set_ylim(bottom=0)
        total = int(restarts[-1]) if restarts else 0
        counts.set_title(f"churn phase: engine counters (red: {total} engine restarts)")
        counts.set_xlabel("s since the phase started (red: a new engine process ready)")
        counts.set_ylabel("count since the phase started")
        counts.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
