"""``python -m benchmarks.contention``'s Markdown: the bandwidth bound, one table row per scenario,
spin setting, system and busy count, and issue 20's checks."""

from __future__ import annotations

from typing import Any

HEADER = (
    "| scenario | spin | system | busy | tok/s (median) | per repeat | busy/quiet worst | "
    "step p50 / p90 / p99 ms | cpu/wall | loraplex/vLLM (median, worst) |"
)


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pair(ratios: dict[str, Any] | None) -> str:
    if ratios is None:
        return ""
    return f"{_num(ratios['median'], 2)}, {_num(ratios['worst'], 2)}"


def rows(result: dict[str, Any]) -> list[str]:
    out = []
    for scenario, spins in result["summary"]["by_scenario"].items():
        for spin, cell in spins.items():
            for system in ("loraplex", "vllm"):
                for busy, e in cell.get(system, {}).items():
                    vs = e.get("vs_quiet", {}).get("worst")
                    step = e["step_ms"]
                    over = (
                        cell.get("loraplex_over_vllm", {}).get(busy)
                        if system == "loraplex"
                        else None
                    )
                    rate = _num(e["median_tokens_per_s"])
                    if "median_decode_tokens_per_s" in e:
                        rate += f" (decode {_num(e['median_decode_tokens_per_s'])})"
                    out.append(
                        f"| {scenario} | {spin} | {system} | {busy} | {rate} | "
                        f"{', '.join(_num(v) for v in e['per_repeat_tokens_per_s'])} | "
                        f"{_num(vs, 2) if busy != '0' else ''} | "
                        f"{_num(step['p50'])} / {_num(step['p90'])} / {_num(step['p99'])} | "
                        f"{_num(e['cpu_per_wall'], 2)} | "
                        f"{_pair(over)} |"
                    )
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# python -m benchmarks.contention, {result['timestamp']}",
        "",
        f"`{result['command']}`",
        "",
    ]
    bound = result["summary"]["bandwidth_bound"]
    if bound:
        lines += [
            f"Copy bandwidth {bound['copy_bytes_per_s'] / 1e9:.2f} GB/s "
            f"({bound['copy_convention']}); weights "
            f"{bound['weight_bytes_per_token'] / 1e6:.1f} MB per token; batch-1 bound "
            f"{bound['tokens_per_s']:.1f} tok/s.",
            "",
        ]
    lines += [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|", *rows(result), ""]
    for c in result["summary"]["checks"]:
        verdict = {True: "met", False: "NOT met", None: "n/a"}[c["met"]]
        lines.append(
            f"- {c['scenario']}, spin {c['spin']}: {c['what']} = {_num(c['value'], 3)} "
            f"(target {c['target']}): {verdict}"
        )
    for w in result.get("warnings", []):
        lines.append(f"- warning: {w}")
    return "\n".join(lines)
