"""``loraplex bench throughput --num-adapters 1,2,4,...,128``: adapters at scale (issue 15).

One process. For each N in the sweep a fresh engine (built once per N, ``max_loras`` = N) runs
the same workload with every request on its adapter (``loraplex``) and without adapters
(``loraplex_base``), alternating repeats (forward order on even repeats, reversed on odd ones),
so each (with, without) pair ran back to back; per N: median tokens/s of each, their ratio and
the median of the paired ratios, and the device adapter pool's stats after the timed runs.

The pool (``lora_memory``) is by default exactly the N adapters' real size,
``rank × Σ_modules (in + out) × layers × bytes per value`` each, so it holds all N; or
``--pool-adapters K`` (adapters 0 .. K-1) or ``--lora-memory``. With a pool smaller than the
adapters in use (the power-law scenario: 256 registered, 64 resident) the timed runs load and
evict adapters; ``load_waits`` (steps that waited on a copy) and failed requests must stay 0.

Adapters are random (``adapters.make_random_adapters``), ranks cycled from ``--adapter-ranks``,
written once for the whole sweep to a temporary directory that is deleted when the run ends.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loraplex.bench.adapters import (
    DELTA_RELATIVE_NORM,
    TARGET_MODULES,
    adapter_name,
    adapter_ranks,
    assign_adapters,
    make_random_adapters,
    requests_per_adapter,
)
from loraplex.bench.common import (
    Log,
    ThroughputOptions,
    load_throughput_workload,
    machine,
    options_json,
    reset_prefix_cache_for,
    workload_json,
)
from loraplex.bench.flops import ModelShape
from loraplex.bench.multi_lora import run_order
from loraplex.bench.pool_sizing import pool_plan, value_bytes
from loraplex.bench.report import write_json
from loraplex.bench.systems import RunResult, check_lengths, flat_stats
from loraplex.bench.workload import encode, make_workload
from loraplex.config import MAX_LORAS

# Issue 15: loraplex with N distinct adapters over loraplex without, at least this.
RATIO_TARGETS = {32: 0.9, 64: 0.85, 128: 0.75}
USED_OVER_REAL_TARGET = 1.25  # pool bytes used / the resident adapters' real bytes, at most
# The pool's gauges after a run (engine_stats().lora), reported per run and per N.
POOL_GAUGES = (
    "lora_pool_bytes",
    "lora_pool_bytes_used",
    "lora_adapter_bytes",
    "lora_pool_pages",
    "lora_pool_pages_used",
    "lora_loads_in_flight",
    "lora_resident_device",
    "lora_resident_host",
    "lora_registered",
)
# Counters summed over the timed runs with adapters.
TIMED_COUNTERS = (
    "lora_slot_loads",
    "lora_slot_evictions",
    "lora_load_waits",
    "lora_loads_deferred",
    "lora_load_bytes",
    "lora_disk_loads",
    "lora_host_hits",
    "lora_host_evictions",
    "num_preemptions",
)


def weight_traffic(
    shape: ModelShape,
    assignment: Sequence[int],
    output_lens: Sequence[int],
    sizes: Sequence[int],
    vbytes: int,
) -> dict[str, Any]:
    """Weight bytes one decode step reads: the base model's against its distinct adapters'.

    Decode step t (1 .. max - 1) runs every request with more than t output tokens (all requests
    decode together when ``max_num_seqs`` >= the requests; an upper estimate when the pool holds
    fewer adapters than that); it reads each distinct adapter among them once. If every step
    took time in proportion to the weight bytes it reads, tokens/s with adapters over without
    would be base / (base + adapters)."""
    base = shape.decode_weight_bytes(vbytes)
    steps = [
        {assignment[i] for i, n in enumerate(output_lens) if n > t}
        for t in range(1, max(output_lens))
    ]  # the distinct adapters of each decode step
    per_step = [sum(sizes[k] for k in step) for step in steps]
    counts = [len(step) for step in steps]
    mean = statistics.fmean(per_step) if per_step else 0.0
    peak = max(per_step, default=0)
    return {
        "base_weight_bytes_per_step": base,
        "adapters_per_step_max": max(counts, default=0),
        "adapters_per_step_mean": round(statistics.fmean(counts), 2) if counts else 0.0,
        "adapter_bytes_per_step_max": peak,
        "adapter_bytes_per_step_mean": round(mean),
        "adapter_over_base_max": round(peak / base, 3),
        "adapter_over_base_mean": round(mean / base, 3),
        "ratio_if_bandwidth_bound": round(base / (base + mean), 3),
    }


def run_lora_scale(opts: ThroughputOptions, say: Log) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-adapters-") as tmp:
        return _run(opts, say, Path(tmp))


def _run(opts: ThroughputOptions, say: Log, adapter_root: Path) -> dict[str, Any]:
    from loraplex import LoRARequest

    loaded = load_throughput_workload(opts)
    model_dir, tokenizer, prompts, lens = (
        loaded.model_dir,
        loaded.tokenizer,
        loaded.prompts,
        loaded.output_lens,
    )
    shape = ModelShape.from_config(loaded.model_config)
    workload = loaded.workload
    registered = opts.registered
    ranks = adapter_ranks(registered, opts.ranks)
    vbytes = value_bytes(opts.engine.lora_dtype)
    sizes = [shape.lora_bytes(r, vbytes) for r in ranks]  # real bytes of each adapter
    say(f"model: {model_dir}")
    say(
        f"workload: {opts.num_requests} requests, outputs {min(lens)}-{max(lens)} tokens "
        f"({sum(lens)} in all), greedy, EOS ignored; adapters per N: {list(opts.counts)} "
        f"({opts.dist}), {opts.num_registered or 'N'} registered"
    )
    started = time.perf_counter()
    dirs = make_random_adapters(
        model_dir, adapter_root, registered, rank=opts.ranks, seed=opts.seed
    )
    say(
        f"{registered} random adapters (ranks {'/'.join(map(str, opts.ranks))}) written in "
        f"{time.perf_counter() - started:.1f} s (temporary, not timed)"
    )
    requests = {name: LoRARequest(name, path) for name, path in dirs.items()}
    warm = [
        encode(tokenizer, p, chat=opts.chat)
        for p in make_workload(4, 4, 4, seed=opts.seed + 1_000_003).prompts
    ]
    content_hashes: dict[str, str] = {}
    points: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "benchmark": "throughput-lora-scale",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": opts.command_line(),
        "options": options_json(opts),
        "machine": machine(),
        "model": {"dir": model_dir, "shape": asdict(shape)},
        "workload": workload_json(workload, prompts),
        "adapters": {
            "registered": opts.num_registered or "N",  # adapters added to each engine
            "written": registered,
            "counts": list(opts.counts),
            "distribution": opts.dist,
            "powerlaw_alpha": opts.powerlaw_alpha if opts.dist == "powerlaw" else None,
            "rank_cycle": list(opts.ranks),
            "ranks": ranks,
            "target_modules": list(TARGET_MODULES),
            "bytes_per_value": vbytes,
            "real_bytes": sizes,
            "real_bytes_rule": "rank x sum over the seven projections of (in + out) x layers x "
            "bytes per value",
            "delta_relative_norm": DELTA_RELATIVE_NORM,
            "content_hashes": content_hashes,
            "where": "random PEFT adapters in a temporary directory, deleted after the run",
        },
        "engine_build": "a fresh engine per N (max_loras and the pool sized for that N); "
        "adapters 0 .. R-1 added (R: --num-registered, else N), then one short request on each "
        "adapter the pool holds (adapters 0 .. holds-1), all before timing",
        "pool_rule": _pool_rule(opts),
        "host_cache_rule": (
            f"max_cpu_loras = {opts.max_cpu_loras}: adapters evicted from host memory are "
            "parsed from disk again"
            if opts.max_cpu_loras
            else "max_cpu_loras = every registered adapter: host memory holds all of them, so "
            "pool loads copy from host memory, never from disk"
        ),
        "weight_traffic_convention": weight_traffic.__doc__,
        "ratio_targets": {str(k): v for k, v in RATIO_TARGETS.items()},
        "used_over_real_target": USED_OVER_REAL_TARGET,
        "complete": False,  # True once every N has run
        "points": points,
        "table": [],
        "warnings": [],
    }
    out = _output_stem(opts)
    for n in opts.counts:
        point = _measure_n(opts, n, say, model_dir, prompts, lens, requests, sizes, warm)
        content_hashes.update(point.pop("content_hashes"))
        point["weight_traffic"] = weight_traffic(shape, point["assignment"], lens, sizes, vbytes)
        points.append(point)
        result["table"] = [_row(p) for p in points]
        result["warnings"] = [w for p in points for w in p["warnings"]]
        if n != opts.counts[-1]:  # a long sweep keeps what it measured if a later N fails
            partial = out.parent / f"{out.name}.json"
            write_json(result, partial)
            say(f"N={n} done; results so far: {partial}")
    result["complete"] = True
    _write(result, opts, out)
    return result


def _pool_rule(opts: ThroughputOptions) -> str:
    if opts.lora_memory is not None:
        return f"lora_memory = {opts.lora_memory} (--lora-memory) for every N"
    if opts.pool_adapters is not None:
        return f"lora_memory = the real bytes of adapters 0 .. {opts.pool_adapters - 1}"
    return "lora_memory = the real bytes of the N adapters in use: the pool holds all N"


def _measure_n(
    opts: ThroughputOptions,
    n: int,
    say: Log,
    model_dir: str,
    prompts: list[list[int]],
    lens: list[int],
    requests: dict[str, Any],
    sizes: list[int],
    warm: list[list[int]],
) -> dict[str, Any]:
    from loraplex.bench.systems import build_llm, greedy_params, run_loraplex, warm_up_loraplex

    assignment = assign_adapters(
        opts.num_requests, n, opts.dist, alpha=opts.powerlaw_alpha, seed=opts.seed
    )
    loras = [requests[adapter_name(k)] for k in assignment]
    memory, holds = pool_plan(opts, n, sizes)
    overrides = {
        "max_loras": min(n, opts.max_loras or max(holds, 1), MAX_LORAS),
        "max_cpu_loras": opts.max_cpu_loras or opts.num_registered or n,
        "max_lora_rank": opts.max_lora_rank,
        "lora_memory": memory,
    }
    hashes: dict[str, str] = {}

    def fresh_llm() -> Any:
        t0 = time.perf_counter()
        llm = build_llm(model_dir, opts.engine, **overrides)
        warm_up_loraplex(llm, warm)
        mine = [requests[adapter_name(k)] for k in range(opts.num_registered or n)]
        hashes.update({req.lora_name: llm.add_lora(req) for req in mine})
        hot = [requests[adapter_name(k)] for k in range(holds)]
        llm.generate(
            [warm[i % len(warm)] for i in range(len(hot))],
            greedy_params([4] * len(hot)),
            lora_request=hot,
            use_tqdm=False,
        )
        # One untimed run of the timed workload itself: an engine's first full-size run pays
        # one-time costs (KV-cache pages faulted in, allocator growth) that would otherwise land
        # on whichever system runs first (it measured slower than the later repeats).
        llm.generate(
            [list(p) for p in prompts], greedy_params(lens), lora_request=loras, use_tqdm=False
        )
        reset_prefix_cache_for(llm, opts)
        say(
            f"N={n}: engine built, {len(mine)} adapters added, {len(hot)} warmed, the workload "
            f"run once in {time.perf_counter() - t0:.1f} s (not timed)"
        )
        return llm

    llm = fresh_llm()
    runs: list[RunResult] = []
    warnings: list[str] = []
    for r in range(opts.repeats):
        for system in run_order(r, opts.run_systems):
            if runs and not reset_prefix_cache_for(llm, opts):
                del llm
                gc.collect()
                llm = fresh_llm()
            with_lora = system == "loraplex"
            run = run_loraplex(
                llm, prompts, lens, r, lora_requests=loras if with_lora else None, system=system
            )
            gauges = flat_stats(llm.engine_stats())
            run.engine.update({k: v for k, v in gauges.items() if k in POOL_GAUGES})
            runs.append(run)
            say(
                f"N={n} repeat {r + 1}/{opts.repeats} {system:13s}: {run.output_tokens} tokens "
                f"in {run.seconds:.2f} s = {run.tokens_per_s:.1f} tok/s"
                + (f", {run.failures} failed" if run.failures else "")
            )
            problem = check_lengths(run, lens)
            if problem:
                say(f"warning: N={n}: {problem}")
                warnings.append(f"N={n}: {problem}")
    final = flat_stats(llm.engine_stats())
    del llm
    gc.collect()
    return {
        "num_adapters": n,
        "assignment": assignment,
        "requests_per_adapter": requests_per_adapter(assignment, n),
        "engine_lora": overrides,
        "pool_holds_adapters": holds,
        "summary": summarize(runs, n),
        "pool": pool_stats(final, sum(sizes[:n])),
        "timed": timed_counters(runs),
        "failures": sum(r.failures for r in runs),
        "runs": [r.to_json() for r in runs],
        "warnings": warnings,
        "content_hashes": hashes,
    }


def summarize(runs: Sequence[RunResult], n: int) -> dict[str, Any]:
    """Per system the median tokens/s; the with/without ratio (of medians, and the median of
    the paired ratios: repeat r's two runs ran back to back) against issue 15's target."""
    per: dict[str, dict[str, Any]] = {}
    for system in ("loraplex", "loraplex_base"):
        rates = [r.tokens_per_s for r in runs if r.system == system]
        if rates:
            per[system] = {
                "per_repeat_tokens_per_s": [round(v, 3) for v in rates],
                "median_tokens_per_s": round(statistics.median(rates), 3),
            }
    out: dict[str, Any] = {"systems": per, "ratio": None, "per_repeat_ratio": []}
    if "loraplex" in per and "loraplex_base" in per and per["loraplex_base"]["median_tokens_per_s"]:
        x = per["loraplex"]["per_repeat_tokens_per_s"]
        y = per["loraplex_base"]["per_repeat_tokens_per_s"]
        paired = [round(u / v, 3) for u, v in zip(x, y, strict=True) if v > 0]
        out["ratio"] = round(
            per["loraplex"]["median_tokens_per_s"] / per["loraplex_base"]["median_tokens_per_s"], 3
        )
        out["per_repeat_ratio"] = paired
        out["median_paired_ratio"] = round(statistics.median(paired), 3) if paired else None
    target = RATIO_TARGETS.get(n)
    out["target"] = target
    out["target_met"] = None if target is None or out["ratio"] is None else out["ratio"] >= target
    return out


def pool_stats(stats: dict[str, float], real_bytes: int) -> dict[str, Any]:
    """The pool after the timed runs: its size, what it holds and their real size."""
    g: dict[str, Any] = {k.removeprefix("lora_"): int(stats.get(k, 0)) for k in POOL_GAUGES}
    used, real = g["pool_bytes_used"], g["adapter_bytes"]
    g["used_over_real"] = round(used / real, 4) if real else None
    g["used_over_real_target_met"] = None if not real else used <= USED_OVER_REAL_TARGET * real
    g["workload_adapters_real_bytes"] = real_bytes  # adapters 0 .. N-1, computed from the shape
    g["pool_over_workload_real"] = round(g["pool_bytes"] / real_bytes, 4) if real_bytes else None
    return g


def timed_counters(runs: Sequence[RunResult]) -> dict[str, int]:
    """Counters summed over the timed runs with adapters (the base runs load nothing)."""
    mine = [r for r in runs if r.system == "loraplex"]
    return {
        k.removeprefix("lora_"): int(sum(r.engine.get(k, 0) for r in mine)) for k in TIMED_COUNTERS
    }


def _row(p: dict[str, Any]) -> dict[str, Any]:
    """One N's quotable line (``table`` in the JSON, a row of the Markdown table)."""
    s, pool, traffic = p["summary"], p["pool"], p.get("weight_traffic", {})
    per = s["systems"]
    return {
        "num_adapters": p["num_adapters"],
        "tokens_per_s_with": per.get("loraplex", {}).get("median_tokens_per_s"),
        "tokens_per_s_base": per.get("loraplex_base", {}).get("median_tokens_per_s"),
        "ratio": s["ratio"],
        "median_paired_ratio": s.get("median_paired_ratio"),
        "target": s["target"],
        "pool_mb": round(pool["pool_bytes"] / 1e6, 3),
        "pool_used_mb": round(pool["pool_bytes_used"] / 1e6, 3),
        "adapter_mb": round(pool["adapter_bytes"] / 1e6, 3),
        "used_over_real": pool["used_over_real"],
        "slot_loads": p["timed"]["slot_loads"],
        "slot_evictions": p["timed"]["slot_evictions"],
        "load_waits": p["timed"]["load_waits"],
        "failures": p["failures"],
        "adapter_over_base_bytes_mean": traffic.get("adapter_over_base_mean"),
        "ratio_if_bandwidth_bound": traffic.get("ratio_if_bandwidth_bound"),
    }


def _output_stem(opts: ThroughputOptions) -> Path:
    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = "-".join(map(str, opts.counts))
    return out_dir / f"throughput-lora-scale-{counts}-{opts.dist}-{time.strftime('%Y%m%d-%H%M%S')}"


def _write(result: dict[str, Any], opts: ThroughputOptions, out: Path) -> None:
    from loraplex.bench import lora_scale_report as report

    out_dir, stem = out.parent, out.name
    table = report.markdown(result)
    (out_dir / f"{stem}.md").write_text(table + "\n")
    plot_note = report.write_plot(result, out_dir / f"{stem}.png")
    result["plot"] = plot_note or str(out_dir / f"{stem}.png")
    result["markdown"] = str(out_dir / f"{stem}.md")
    write_json(result, out_dir / f"{stem}.json")
    print()
    print(table)
    print()
    print(f"results: {out_dir / f'{stem}.json'}")
    print(f"table: {out_dir / f'{stem}.md'}")
    print(f"plot: {plot_note}" if plot_note else f"plot: {out_dir / f'{stem}.png'}")
    print(f"reproduce: {opts.command_line()}")
