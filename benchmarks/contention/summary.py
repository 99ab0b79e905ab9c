"""``python -m benchmarks.contention``'s figures from its runs: per scenario, spin setting, system and
busy count the tokens/s and step-time percentiles, the busy/quiet and loraplex/vLLM ratios
(within a repeat: runs close in time), the batch-1 bandwidth bound and issue 20's checks."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.contention.options import ContentionOptions
from loraplex.bench.systems import greedy_agreement

# Issue 20's targets.
BUSY_OVER_QUIET_TARGET = 0.5  # workload, one busy process, worst of the pairs
BATCH1_OF_BOUND_TARGET = 0.6
OVER_VLLM_QUIET_TARGET = {"base": 2.0, "adapters": 4.0}
OVER_VLLM_BUSY_TARGET = 1.0  # ahead of vLLM under the same contention


def warnings(runs: list[dict[str, Any]]) -> list[str]:
    """Runs that did not do the workload's work, or lost a busy process on the way."""
    out = []
    for r in runs:
        where = (
            f"{r['system']} {r['scenario']} spin={r['spin']} repeat {r['repeat'] + 1} "
            f"busy={r['busy']}"
        )
        if r["output_tokens"] != r["expected_tokens"]:
            out.append(
                f"{where}: {r['output_tokens']} output tokens, expected {r['expected_tokens']}"
            )
        if not r["busy_ran_throughout"]:
            out.append(f"{where}: a busy process ended during the run")
    return out


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def _ratios(xs: Sequence[float], ys: Sequence[float]) -> dict[str, Any]:
    paired = [round(x / y, 3) for x, y in zip(xs, ys, strict=True) if y > 0]
    return {
        "per_repeat": paired,
        "median": _median(paired),
        "worst": min(paired) if paired else None,
    }


def summarize(
    runs: list[dict[str, Any]],
    outputs: dict[tuple[str, str, str, int, int], list[list[int]]],
    opts: ContentionOptions,
    result: dict[str, Any],
) -> dict[str, Any]:
    """Per scenario and spin setting: per system and busy count the tokens/s (per repeat,
    median), step-time percentiles (median over repeats) and the busy/quiet ratios; the
    loraplex/vLLM ratios; the bandwidth bound; issue 20's checks."""
    bound = bandwidth_bound(result)
    table: dict[str, dict[str, Any]] = {}
    checks: list[dict[str, Any]] = []
    for scenario in opts.scenarios:
        table[scenario] = {}
        for spin in opts.spincounts:
            cell: dict[str, Any] = {}
            for system in ("loraplex", "vllm"):
                per = _system_cell(runs, system, spin, scenario, opts)
                if per:
                    cell[system] = per
            if not cell:
                continue
            if "vllm" in cell:
                cell["loraplex_over_vllm"] = {
                    str(b): _ratios(
                        cell["loraplex"][str(b)]["per_repeat_tokens_per_s"],
                        cell["vllm"][str(b)]["per_repeat_tokens_per_s"],
                    )
                    for b in opts.busy
                    if str(b) in cell["vllm"] and str(b) in cell["loraplex"]
                }
                key = (spin, scenario, 0, 0)
                if ("loraplex", *key) in outputs and ("vllm", *key) in outputs:
                    cell["greedy_agreement_vs_vllm"] = greedy_agreement(
                        outputs[("loraplex", *key)], outputs[("vllm", *key)]
                    )
            if scenario == "batch1" and bound and "loraplex" in cell:
                for entry in cell["loraplex"].values():
                    rate = entry.get("median_decode_tokens_per_s")
                    entry["decode_of_bound"] = (
                        round(rate / bound["tokens_per_s"], 3) if rate else None
                    )
            table[scenario][spin] = cell
            checks += _checks(scenario, spin, cell, opts)
    # The same greedy tokens in every loraplex run of a scenario: each setting did the same work.
    same = {
        scenario: len(
            {str(v) for k, v in outputs.items() if (k[0], k[2]) == ("loraplex", scenario)}
        )
        <= 1
        for scenario in opts.scenarios
    }
    return {
        "bandwidth_bound": bound,
        "by_scenario": table,
        "checks": checks,
        "loraplex_outputs_identical_across_runs": same,
    }


def _system_cell(
    runs: list[dict[str, Any]], system: str, spin: str, scenario: str, opts: ContentionOptions
) -> dict[str, Any]:
    per: dict[str, Any] = {}
    for b in opts.busy:
        mine = sorted(
            (
                r
                for r in runs
                if (r["system"], r["spin"], r["scenario"], r["busy"]) == (system, spin, scenario, b)
            ),
            key=lambda r: r["repeat"],
        )
        if not mine:
            continue
        rates = [r["tokens_per_s"] for r in mine]
        entry: dict[str, Any] = {
            "per_repeat_tokens_per_s": rates,
            "median_tokens_per_s": _median(rates),
            "step_ms": {
                q: _median([(r["steps"] or {}).get(f"{q}_ms") for r in mine])
                for q in ("p50", "p90", "p99")
            },
            "cpu_per_wall": _median([r["cpu_per_wall"] for r in mine]),
        }
        if scenario == "batch1":
            decode = [r.get("decode_tokens_per_s") for r in mine]
            entry["per_repeat_decode_tokens_per_s"] = decode
            entry["median_decode_tokens_per_s"] = _median(decode)
        per[str(b)] = entry
    quiet = per.get("0")
    for count, entry in per.items():
        if count != "0" and quiet:
            entry["vs_quiet"] = _ratios(
                entry["per_repeat_tokens_per_s"], quiet["per_repeat_tokens_per_s"]
            )
    return per


def bandwidth_bound(result: dict[str, Any]) -> dict[str, Any] | None:
    """Copy bandwidth (the best probe) over weight bytes per token: batch 1's ceiling."""
    probes = result["bandwidth_probes"]
    weights = [c["weight_bytes"] for c in result["children"] if c.get("system") == "loraplex"]
    if not probes or not weights:
        return None
    bandwidth = max(p["bytes_per_s"] for p in probes)
    return {
        "copy_bytes_per_s": bandwidth,
        "copy_convention": probes[0]["convention"],
        "weight_bytes_per_token": weights[0],
        "weight_rule": "every parameter of the engine's model read once per decoded token "
        "(tied embeddings once), in the engine's dtype",
        "tokens_per_s": round(bandwidth / weights[0], 3),
    }


def _checks(
    scenario: str, spin: str, cell: dict[str, Any], opts: ContentionOptions
) -> list[dict[str, Any]]:
    def check(
        what: str, value: float | None, target: float, at_least: bool = True
    ) -> dict[str, Any]:
        met = None if value is None else (value >= target if at_least else value > target)
        return {
            "scenario": scenario,
            "spin": spin,
            "what": what,
            "value": value,
            "target": target,
            "met": met,
        }

    out = []
    lp = cell.get("loraplex", {})
    if scenario == "workload" and "1" in lp:
        out.append(
            check(
                "loraplex busy=1 / quiet, worst pair",
                lp["1"]["vs_quiet"]["worst"],
                BUSY_OVER_QUIET_TARGET,
            )
        )
    if scenario == "workload" and "loraplex_over_vllm" in cell:
        ratios = cell["loraplex_over_vllm"]
        kind = "adapters" if opts.num_adapters else "base"
        if "0" in ratios:
            out.append(
                check(
                    f"loraplex / vLLM quiet ({kind}), median pair",
                    ratios["0"]["median"],
                    OVER_VLLM_QUIET_TARGET[kind],
                )
            )
        if "1" in ratios:
            out.append(
                check(
                    "loraplex / vLLM busy=1, worst pair",
                    ratios["1"]["worst"],
                    OVER_VLLM_BUSY_TARGET,
                    at_least=False,
                )
            )
    if scenario == "batch1" and "0" in lp and "decode_of_bound" in lp["0"]:
        out.append(
            check(
                "loraplex batch-1 decode / bandwidth bound, quiet",
                lp["0"]["decode_of_bound"],
                BATCH1_OF_BOUND_TARGET,
            )
        )
    return out
