"""``loraplex bench throughput --num-adapters N``: one workload spread over N LoRA adapters.

Four systems, one process, one run, alternating repeats (forward order on even repeats, reversed
on odd ones, so drift of a shared machine hits all alike and each pair of neighbours runs back to
back):

1. ``loraplex``: every request with its adapter (``max_loras`` = N, or ``--max-loras``);
2. ``loraplex_base``: the same engine, prompts and output lengths, no adapter (LoRA's cost);
3. ``peft_static``: PEFT, per-adapter static batches; 4. ``peft_mixed``: PEFT mixed-adapter batches.

Headline ratios: loraplex over the best PEFT baseline, and loraplex with adapters over without.
The adapters are random (``adapters.make_random_adapters``), written to a temporary directory that
is deleted when the run ends.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loraplex.bench.adapters import (
    DELTA_RELATIVE_NORM,
    TARGET_MODULES,
    adapter_name,
    adapter_ranks,
    adapter_weights,
    assign_adapters,
    make_random_adapters,
    requests_per_adapter,
)
from loraplex.bench.common import (
    ThroughputOptions,
    load_throughput_workload,
    machine,
    options_json,
    reset_prefix_cache_for,
    workload_json,
)
from loraplex.bench.flops import ModelShape, workload_flops
from loraplex.bench.peft_baselines import (
    Batch,
    PeftBaselines,
    PeftMode,
    describe,
    mixed_plan,
    select_batches,
    static_plan,
)
from loraplex.bench.systems import (
    ADAPTER_SYSTEMS,
    RunResult,
    System,
    check_lengths,
    flat_stats,
    greedy_agreement,
)
from loraplex.bench.workload import encode, make_workload
from loraplex.config import MAX_LORAS

Log = Callable[[str], None]
SYSTEMS: tuple[System, ...] = ADAPTER_SYSTEMS
TARGETS = {"speedup_vs_best_peft": 4.0, "lora_with_over_without": 0.85}
LORA_GAUGES = ("lora_resident_device", "lora_resident_host", "lora_registered")


def run_order(repeat: int, systems: Sequence[System]) -> list[System]:
    return list(systems) if repeat % 2 == 0 else list(reversed(systems))


def run_multi_lora(opts: ThroughputOptions, say: Log) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-adapters-") as tmp:
        return _run(opts, say, Path(tmp))


def _run(opts: ThroughputOptions, say: Log, adapter_root: Path) -> dict[str, Any]:
    from loraplex import LoRARequest
    from loraplex.bench.peak import measure_fp32_peak_gflops
    from loraplex.bench.systems import build_llm, run_loraplex, warm_up_loraplex

    loaded = load_throughput_workload(opts)
    model_dir, tokenizer, prompts, lens = (
        loaded.model_dir,
        loaded.tokenizer,
        loaded.prompts,
        loaded.output_lens,
    )
    shape = ModelShape.from_config(loaded.model_config)
    workload = loaded.workload
    n_adapters = opts.num_adapters
    assignment = assign_adapters(
        opts.num_requests, n_adapters, opts.dist, alpha=opts.powerlaw_alpha, seed=opts.seed
    )
    names = [adapter_name(k) for k in assignment]  # per request

    say(f"model: {model_dir}")
    say(
        f"workload: {opts.num_requests} requests over {n_adapters} adapters "
        f"({opts.dist}), per adapter {requests_per_adapter(assignment, n_adapters)}; "
        f"outputs {min(lens)}-{max(lens)} tokens ({sum(lens)} in all), greedy, EOS ignored"
    )
    started = time.perf_counter()
    dirs = make_random_adapters(
        model_dir, adapter_root, n_adapters, rank=opts.ranks, seed=opts.seed
    )
    say(
        f"{n_adapters} random rank-{'/'.join(map(str, opts.ranks))} adapters written in "
        f"{time.perf_counter() - started:.1f} s (temporary, not timed)"
    )
    requests = {name: LoRARequest(name, path) for name, path in dirs.items()}
    loras = [requests[n] for n in names]

    peaks = [measure_fp32_peak_gflops()]
    say(f"fp32 matmul peak (torch.mm 2048², best of 7): {peaks[0]:.1f} GFLOP/s")
    warm = [
        encode(tokenizer, p, chat=opts.chat)
        for p in make_workload(4, 4, 4, seed=opts.seed + 1_000_003).prompts
    ]
    engine_overrides: dict[str, Any] = {
        "max_loras": min(n_adapters, opts.max_loras or n_adapters, MAX_LORAS),
        "max_cpu_loras": opts.max_cpu_loras or n_adapters,  # default: every adapter fits
        "max_lora_rank": opts.max_lora_rank,
    }
    if opts.lora_memory is not None or opts.pool_adapters is not None:
        from loraplex.bench.pool_sizing import pool_plan, value_bytes

        vbytes = value_bytes(opts.engine.lora_dtype)
        sizes = [shape.lora_bytes(r, vbytes) for r in adapter_ranks(n_adapters, opts.ranks)]
        engine_overrides["lora_memory"] = pool_plan(opts, n_adapters, sizes)[0]

    content_hashes: dict[str, str] = {}

    def fresh_llm() -> Any:
        t0 = time.perf_counter()
        llm = build_llm(model_dir, opts.engine, **engine_overrides)
        warm_up_loraplex(llm, warm)
        # Add every adapter, then one short request each: disk and host loads, slot loads (while
        # N <= max_loras) and the LoRA path's first-call costs all stay out of the timing.
        content_hashes.update({name: llm.add_lora(req) for name, req in requests.items()})
        order = list(requests.values())
        llm.generate(
            [warm[i % len(warm)] for i in range(len(order))],
            _greedy([4] * len(order)),
            lora_request=order,
            use_tqdm=False,
        )
        say(f"loraplex loaded and warmed up in {time.perf_counter() - t0:.1f} s (not timed)")
        return llm

    llm = fresh_llm()
    peft: PeftBaselines | None = None
    subsets: dict[PeftMode, list[Batch]] = {}
    plans: dict[PeftMode, list[Batch]] = {}
    if opts.with_peft:
        t0 = time.perf_counter()
        peft = PeftBaselines(model_dir, opts.engine.dtype, dirs)
        peft.warm_up(warm)
        say(f"PEFT baselines loaded and warmed up in {time.perf_counter() - t0:.1f} s (not timed)")
        every: dict[PeftMode, list[Batch]] = {
            "peft_static": static_plan(names, opts.hf_batch_size),
            "peft_mixed": mixed_plan(names, opts.peft_mixed_batch_size),
        }
        plans = {mode: plan for mode, plan in every.items() if mode in opts.run_systems}
        for mode, plan in plans.items():
            subsets[mode] = select_batches(
                plan, opts.hf_max_requests, by_adapter=mode == "peft_static"
            )
            d = describe(subsets[mode], lens)
            say(
                f"{mode}: {d['requests']} requests in {d['batches']} whole batches "
                f"{d['batch_sizes']}, {d['adapters_covered']} adapters"
            )

    systems = list(opts.run_systems)
    runs: list[RunResult] = []
    warnings: list[str] = []
    for r in range(opts.repeats):
        for system in run_order(r, systems):
            if system in ("loraplex", "loraplex_base"):
                if runs and not reset_prefix_cache_for(llm, opts):
                    del llm
                    gc.collect()
                    llm = fresh_llm()
                with_lora = system == "loraplex"
                run = run_loraplex(
                    llm, prompts, lens, r, lora_requests=loras if with_lora else None, system=system
                )
                gauges = flat_stats(llm.engine_stats())
                run.engine.update({k: v for k, v in gauges.items() if k in LORA_GAUGES})
            else:
                assert peft is not None and system in ("peft_static", "peft_mixed")
                which: PeftMode = "peft_static" if system == "peft_static" else "peft_mixed"
                run = peft.run(which, subsets[which], prompts, lens, r)
            runs.append(run)
            say(
                f"repeat {r + 1}/{opts.repeats} {system:13s}: {run.num_requests} requests, "
                f"{run.output_tokens} tokens in {run.seconds:.2f} s = {run.tokens_per_s:.1f} tok/s"
            )
            problem = check_lengths(run, lens)
            if problem:
                say(f"warning: {problem}")
                warnings.append(problem)

    peaks.append(measure_fp32_peak_gflops())
    say(f"fp32 matmul peak again: {peaks[1]:.1f} GFLOP/s (the higher one is used)")
    plens = [len(p) for p in prompts]

    rank_of = adapter_ranks(n_adapters, opts.ranks)  # per adapter

    def flops_of(idx: Sequence[int], lora: bool) -> dict[str, int]:
        """Each request at its adapter's rank (0: no adapter)."""
        rank_for = {i: rank_of[assignment[i]] if lora else 0 for i in idx}
        total: dict[str, int] = {}
        for rank in set(rank_for.values()):
            mine = [i for i in idx if rank_for[i] == rank]
            part = workload_flops(
                shape, [plens[i] for i in mine], [lens[i] for i in mine], lora_rank=rank
            )
            total = {k: total.get(k, 0) + v for k, v in part.items()}
        return total

    everyone = range(opts.num_requests)
    flops: dict[str, dict[str, int]] = {
        "loraplex": flops_of(everyone, True),
        "loraplex_base": flops_of(everyone, False),
        **{
            mode: flops_of([i for b in batches for i in b.requests], True)
            for mode, batches in subsets.items()
        },
    }
    result: dict[str, Any] = {
        "benchmark": "throughput-multi-lora",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": opts.command_line(),
        "options": options_json(opts),
        "machine": machine(),
        "model": {"dir": model_dir, "shape": asdict(shape)},
        "workload": workload_json(workload, prompts),
        "adapters": {
            "num_adapters": n_adapters,
            "distribution": opts.dist,
            "powerlaw_alpha": opts.powerlaw_alpha if opts.dist == "powerlaw" else None,
            "popularity": [
                round(w, 4) for w in adapter_weights(n_adapters, opts.dist, opts.powerlaw_alpha)
            ],
            "requests_per_adapter": requests_per_adapter(assignment, n_adapters),
            "assignment": assignment,
            "rank": opts.ranks[0] if len(opts.ranks) == 1 else list(opts.ranks),
            "target_modules": list(TARGET_MODULES),
            "delta_relative_norm": DELTA_RELATIVE_NORM,
            "content_hashes": content_hashes,
            "where": "random PEFT adapters in a temporary directory, deleted after the run",
        },
        "engine_lora": {**engine_overrides},
        "baselines": {
            "hf_max_requests": opts.hf_max_requests,
            "subset_rule": (
                "whole batches of each baseline's full-workload plan, at most hf_max_requests "
                "requests but at least one batch; per-adapter batches visited round-robin over "
                "adapters and taken while they fit; tokens/s of the subset taken as the full "
                "workload's rate"
            ),
            **{
                mode: {"timed": describe(subsets[mode], lens), "full_plan": describe(plan, lens)}
                for mode, plan in plans.items()
            },
        },
        "flops_convention": (
            "as loraplex bench throughput; plus the rank-r LoRA shrink/expand of the seven "
            "projections per computed token for systems with adapters (padding to max_lora_rank "
            "not counted)"
        ),
        "flops": flops,
        "runs": [run.to_json() for run in runs],
        "warnings": warnings,
        "peak_gflops_measured": [round(p, 2) for p in peaks],
    }
    result["summary"] = summarize(runs, flops, max(peaks), opts.num_requests)
    result["greedy_agreement"] = _agreements(runs)
    result["engine_lora_stats"] = {
        k: v for k, v in flat_stats(llm.engine_stats()).items() if k.startswith("lora_")
    }

    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"throughput-lora{n_adapters}-{opts.dist}-{time.strftime('%Y%m%d-%H%M%S')}"
    if peft is not None:
        del peft
        gc.collect()
    if opts.profile:
        _profile(result, llm, opts, prompts, lens, loras, out_dir / f"{stem}-profile.txt", say)
    del llm
    gc.collect()
    from loraplex.bench.prefix_cache import add_prefix_cache_test

    add_prefix_cache_test(result, opts, model_dir, tokenizer, say)
    _write(result, out_dir, stem, opts)
    return result


def _greedy(lens: list[int]) -> list[Any]:
    from loraplex.bench.systems import greedy_params

    return greedy_params(lens)


def summarize(
    runs: Sequence[RunResult], flops: dict[str, dict[str, int]], peak: float, num_requests: int
) -> dict[str, Any]:
    per: dict[str, dict[str, Any]] = {}
    for system in SYSTEMS:
        mine = [r for r in runs if r.system == system]
        if not mine:
            continue
        rates = [r.tokens_per_s for r in mine]
        gflops = [flops[system]["total"] / r.seconds / 1e9 if r.seconds > 0 else 0.0 for r in mine]
        entry: dict[str, Any] = {
            "requests": mine[0].num_requests,
            "extrapolated": mine[0].num_requests < num_requests,
            "per_repeat_tokens_per_s": [round(v, 3) for v in rates],
            "median_tokens_per_s": round(statistics.median(rates), 3),
            "per_repeat_gflops": [round(v, 3) for v in gflops],
            "median_gflops": round(statistics.median(gflops), 3),
            "mfu": round(statistics.median(gflops) / peak, 5),
        }
        if system.startswith("loraplex"):
            for key in ("lora_slot_loads", "lora_disk_loads", "prefix_cache_hits"):
                entry[key] = [r.engine.get(key) for r in mine]
            entry["preemptions"] = [r.engine.get("num_preemptions") for r in mine]
        per[system] = entry

    def ratio(a: str, b: str) -> tuple[float | None, list[float]]:
        if a not in per or b not in per or per[b]["median_tokens_per_s"] <= 0:
            return None, []
        x, y = per[a]["per_repeat_tokens_per_s"], per[b]["per_repeat_tokens_per_s"]
        paired = [round(u / v, 3) for u, v in zip(x, y, strict=True) if v > 0]
        return round(per[a]["median_tokens_per_s"] / per[b]["median_tokens_per_s"], 3), paired

    peft: list[str] = [s for s in ("peft_static", "peft_mixed") if s in per]
    best = max(peft, key=lambda s: per[s]["median_tokens_per_s"]) if peft else None
    speedup, speedup_paired = ratio("loraplex", best) if best else (None, [])
    overhead, overhead_paired = ratio("loraplex", "loraplex_base")
    return {
        "peak_gflops": round(peak, 2),
        "systems": per,
        "best_peft": best,
        "speedup_vs_best_peft": speedup,
        "per_repeat_speedup_vs_best_peft": speedup_paired,
        # Repeat r's systems ran back to back: the median of paired ratios resists drift better.
        "median_paired_speedup_vs_best_peft": _median(speedup_paired),
        "speedup_vs_each_peft": {s: ratio("loraplex", s)[0] for s in peft},
        "lora_with_over_without": overhead,
        "per_repeat_lora_with_over_without": overhead_paired,
        "median_paired_lora_with_over_without": _median(overhead_paired),
        "targets": TARGETS,
        "targets_met": {
            "speedup_vs_best_peft": None
            if speedup is None
            else speedup >= TARGETS["speedup_vs_best_peft"],
            "lora_with_over_without": None
            if overhead is None
            else overhead >= TARGETS["lora_with_over_without"],
        },
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _agreements(runs: Sequence[RunResult]) -> dict[str, Any]:
    """Greedy outputs of the last repeat: loraplex against PEFT on the baseline's requests (the
    same adapters should give nearly the same tokens) and against itself without adapters (the
    adapters must change them)."""
    last: dict[str, RunResult] = {r.system: r for r in runs}
    lp = last.get("loraplex")
    if lp is None:
        return {}
    out: dict[str, Any] = {}
    for other in ("peft_static", "peft_mixed", "loraplex_base"):
        run = last.get(other)
        if run is None:
            continue
        idx = run.indices or list(range(run.num_requests))
        out[f"loraplex_vs_{other}"] = greedy_agreement([lp.outputs[i] for i in idx], run.outputs)
    return out


def _profile(
    result: dict[str, Any],
    llm: Any,
    opts: ThroughputOptions,
    prompts: list[list[int]],
    lens: list[int],
    loras: list[Any],
    path: Path,
    say: Log,
) -> None:
    from loraplex.bench.profile import profile_loraplex

    reset_prefix_cache_for(llm, opts)
    n = min(opts.profile_requests, opts.num_requests)
    say(f"profiling loraplex with adapters on {n} requests ...")
    print(profile_loraplex(llm, prompts[:n], lens[:n], path, lora_requests=loras[:n]))
    result["profile"] = {"requests": n, "table": str(path)}


def _write(result: dict[str, Any], out_dir: Path, stem: str, opts: ThroughputOptions) -> None:
    from loraplex.bench import report

    json_path = out_dir / f"{stem}.json"
    print()
    print(report.multi_lora_table(result))
    if "prefix_cache_test" in result:
        print()
        print(report.prefix_table(result["prefix_cache_test"]))
    plot_note = report.write_multi_lora_plot(result, out_dir / f"{stem}.png")
    result["plot"] = plot_note or str(out_dir / f"{stem}.png")
    report.write_json(result, json_path)
    print()
    print(f"results: {json_path}")
    print(f"plot: {plot_note}" if plot_note else f"plot: {out_dir / f'{stem}.png'}")
    print(f"reproduce: {opts.command_line()}")
