"""Collect one ``scripts/gpu_check.sh`` run's results into ``report.json`` and ``report.md``.

Reads from RESULTS_DIR whatever the stages left (a stage that failed or timed out is reported as
missing, not skipped silently): env.txt (the GPU's name), kernels.json (LoRA kernels),
attention.json, engine.json, tests.log, decode.json and the throughput benchmark JSONs.

    python scripts/gpu_report.py RESULTS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DECODE_TARGET = 0.6  # of the HBM-bandwidth bound, triton + graphs, batch 64 x 1024 (issue 18)
LORA8_TARGET = 0.9  # 8 adapters against the base model


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def gpu_name(results: Path) -> str:
    try:
        lines = (results / "env.txt").read_text().splitlines()
    except OSError:
        return "unknown"
    # nvidia-smi --format=csv: a header line, then "name, memory, driver"
    rows = [ln for ln in lines[1:] if "," in ln and not ln.startswith("torch")]
    return rows[0].split(",")[0].strip() if rows else "unknown"


def throughput(results: Path) -> list[dict[str, Any]]:
    """One row per adapter count: the base-model run, then each N of the adapters sweep
    (``throughput-lora-scale-*.json``: with and without adapters, back to back)."""
    rows: list[dict[str, Any]] = []
    for path in sorted(results.glob("throughput-*.json")):
        data = load(path)
        if not isinstance(data, dict):
            continue
        if data.get("benchmark") == "throughput" and "summary" in data:
            lp = data["summary"].get("loraplex") or {}
            rows.append(
                {"adapters": 0, "tokens_per_s": lp.get("median_tokens_per_s"), "file": path.name}
            )
        for row in data.get("table") or []:  # the adapters-at-scale sweep
            rows.append(
                {
                    "adapters": row.get("num_adapters"),
                    "tokens_per_s": row.get("tokens_per_s_with"),
                    "base_tokens_per_s": row.get("tokens_per_s_base"),
                    "lora_over_base": row.get("ratio"),
                    "file": path.name,
                }
            )
    return sorted(rows, key=lambda r: r["adapters"] or 0)


def tests_summary(results: Path) -> str | None:
    try:
        lines = (results / "tests.log").read_text().splitlines()
    except OSError:
        return None
    finals = [ln.strip("= ") for ln in lines if " passed" in ln or " failed" in ln or "error" in ln]
    return finals[-1] if finals else None


def cases_line(data: Any) -> str:
    if not isinstance(data, dict):
        return "missing (the stage failed or timed out)"
    cases = data.get("cases", [])
    bad = [
        c.get("case")
        or ", ".join(f"{k}={c[k]}" for k in ("dtype", "tokens", "max_loras") if k in c)
        for c in cases
        if not c.get("ok")
    ]
    return f"{len(cases) - len(bad)}/{len(cases)} ok" + (
        f"; failed: {'; '.join(bad)}" if bad else ""
    )


def build(results: Path) -> dict[str, Any]:
    decode = load(results / "decode.json")
    report: dict[str, Any] = {
        "gpu": gpu_name(results),
        "lora_kernels": load(results / "kernels.json"),
        "attention": load(results / "attention.json"),
        "engine": load(results / "engine.json"),
        "tests": tests_summary(results),
        "decode": decode,
        "throughput": throughput(results),
    }
    targets: dict[str, Any] = {}
    if isinstance(decode, dict):
        graphs = next((r for r in decode.get("runs", []) if r.get("config") == "triton+graphs"), {})
        frac = graphs.get("fraction_of_bound_step")
        targets["decode_fraction_of_hbm_bound"] = {
            "value": frac,
            "target": DECODE_TARGET,
            "met": None if frac is None else frac >= DECODE_TARGET,
        }
    eight = next((r for r in report["throughput"] if r["adapters"] == 8), None)
    if eight is not None:
        ratio = eight.get("lora_over_base")
        targets["lora8_over_base"] = {
            "value": ratio,
            "target": LORA8_TARGET,
            "met": None if ratio is None else ratio >= LORA8_TARGET,
        }
    report["targets"] = targets
    return report


def markdown(r: dict[str, Any]) -> str:
    out = [f"# loraplex GPU check on {r['gpu']}", ""]
    out += [
        "| check | result |",
        "|---|---|",
        f"| LoRA kernels, Triton vs torch | {cases_line(r['lora_kernels'])} |",
        f"| paged attention + KV write, Triton vs torch | {cases_line(r['attention'])} |",
        f"| engine: triton (graphs / eager) vs torch, bf16 vs HF | {cases_line(r['engine'])} |",
        f"| pytest on CUDA | {r['tests'] or 'missing'} |",
        "",
    ]
    timing = (r["attention"] or {}).get("timing") if isinstance(r["attention"], dict) else None
    if timing:
        out += [
            f"Attention kernel alone ({timing.get('shape')}): Triton {timing.get('triton_ms')} ms "
            f"(split-KV x4 {timing.get('triton_split4_ms')} ms) vs torch gather + SDPA "
            f"{timing.get('torch_gather_sdpa_ms')} ms; KV read at {timing.get('triton_kv_tb_per_s')} "
            "TB/s.",
            "",
        ]
    decode = r["decode"]
    if isinstance(decode, dict):
        out += [
            f"## Decode, batch {decode['batch']} x {decode['context']} context "
            f"(bound: weights + KV bytes / {decode['hbm_tb_s']} TB/s)",
            "",
            "| config | forward ms | step ms | bound ms | fraction (step) | tokens/s |",
            "|---|---|---|---|---|---|",
        ]
        for run in decode.get("runs", []):
            if "error" in run:
                out.append(f"| {run['config']} | error: {run['error'][:80]} | | | | |")
                continue
            out.append(
                f"| {run['config']} | {run['forward_ms']} | {run['step_ms']} | "
                f"{run['bound_ms']} | {run['fraction_of_bound_step']} | {run['tokens_per_s']} |"
            )
        out.append("")
    if r["throughput"]:
        out += [
            "## Throughput (loraplex bench throughput, output tokens/s)",
            "",
            "| adapters | tokens/s | base tokens/s (same run) | with / without LoRA |",
            "|---|---|---|---|",
        ]
        for row in r["throughput"]:
            out.append(
                f"| {row['adapters']} | {row['tokens_per_s']} | "
                f"{row.get('base_tokens_per_s', '')} | {row.get('lora_over_base', '')} |"
            )
        out.append("")
    if r["targets"]:
        out += ["## Targets (issue 18)", ""]
        for name, t in r["targets"].items():
            out.append(f"- {name}: {t['value']} (target {t['target']}): met = {t['met']}")
        out.append("")
    return "\n".join(out)


def main() -> int:
    results = Path(sys.argv[1])
    report = build(results)
    (results / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (results / "report.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
