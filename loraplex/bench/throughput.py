"""``loraplex bench throughput``: one workload through loraplex and through HF ``generate()``.

Both systems run in the same process on the same machine, alternating, ``repeats`` times; the
result is the ratio of the median output tokens/s (absolute numbers on a shared CPU mean little).
The fp32 matmul peak is measured in the same run so that MFU is a ratio too.

With ``--num-adapters N`` the workload is spread over N LoRA adapters and compared against PEFT
instead (``multi_lora``); with several N, or without the PEFT systems, N is swept with loraplex
alone (``lora_scale``).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loraplex.bench.common import (
    Log,
    ThroughputOptions,
    load_throughput_workload,
    machine,
    options_json,
    reset_prefix_cache_for,
    workload_json,
)
from loraplex.bench.flops import ModelShape, workload_flops
from loraplex.bench.systems import RunResult, check_lengths
from loraplex.bench.workload import encode, make_workload


def run_throughput(opts: ThroughputOptions, log: Log | None = None) -> dict[str, Any]:
    """Run the benchmark, print the tables, write the JSON (and plot); return the result."""
    say: Log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if opts.adapter_mode and opts.with_peft:
        from loraplex.bench.multi_lora import run_multi_lora

        return run_multi_lora(opts, say)
    if opts.adapter_mode:
        from loraplex.bench.lora_scale import run_lora_scale

        return run_lora_scale(opts, say)
    from loraplex.bench import report
    from loraplex.bench.peak import measure_fp32_peak_gflops
    from loraplex.bench.systems import HFBaseline, build_llm, run_loraplex, warm_up_loraplex

    loaded = load_throughput_workload(opts)
    model_dir, tokenizer, prompts, lens = (
        loaded.model_dir,
        loaded.tokenizer,
        loaded.prompts,
        loaded.output_lens,
    )
    shape = ModelShape.from_config(loaded.model_config)
    workload = loaded.workload
    hf_n = min(opts.hf_max_requests or opts.num_requests, opts.num_requests)

    say(f"model: {model_dir}")
    say(
        f"workload: {opts.num_requests} requests, prompts {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, outputs {min(lens)}-{max(lens)} tokens "
        f"({sum(lens)} in all), greedy, EOS ignored"
    )
    peaks = [measure_fp32_peak_gflops()]
    say(f"fp32 matmul peak (torch.mm 2048², best of 7): {peaks[0]:.1f} GFLOP/s")
    warm_prompts = [
        encode(tokenizer, p, chat=opts.chat)
        for p in make_workload(4, 4, 4, seed=opts.seed + 1_000_003).prompts
    ]

    def fresh_llm() -> Any:
        started = time.perf_counter()
        llm = build_llm(model_dir, opts.engine)
        warm_up_loraplex(llm, warm_prompts)
        say(f"loraplex loaded and warmed up in {time.perf_counter() - started:.1f} s (not timed)")
        return llm

    llm = fresh_llm()
    hf = None
    if not opts.skip_hf:
        started = time.perf_counter()
        hf = HFBaseline(model_dir, opts.engine.dtype, opts.hf_batch_size)
        hf.warm_up(warm_prompts)
        say(
            f"HF baseline loaded and warmed up in {time.perf_counter() - started:.1f} s (not timed)"
        )

    runs: list[RunResult] = []
    warnings: list[str] = []
    for r in range(opts.repeats):
        # Alternate which system goes first so slow drift of a shared machine hits both alike.
        order = ["loraplex", "hf"] if r % 2 == 0 else ["hf", "loraplex"]
        for system in order:
            if system == "loraplex":
                if r > 0 and not reset_prefix_cache_for(llm, opts):
                    del llm
                    gc.collect()
                    llm = fresh_llm()
                run = run_loraplex(llm, prompts, lens, r)
            elif hf is not None:
                run = hf.run(prompts[:hf_n], lens[:hf_n], r)
            else:
                continue
            runs.append(run)
            say(
                f"repeat {r + 1}/{opts.repeats} {system:8s}: {run.num_requests} requests, "
                f"{run.output_tokens} tokens in {run.seconds:.2f} s = {run.tokens_per_s:.1f} tok/s"
            )
            problem = check_lengths(run, lens)
            if problem:
                say(f"warning: {problem}")
                warnings.append(problem)

    result: dict[str, Any] = {
        "benchmark": "throughput",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": opts.command_line(),
        "options": options_json(opts),
        "machine": machine(),
        "model": {"dir": model_dir, "shape": asdict(shape)},
        "workload": workload_json(workload, prompts),
        "flops_convention": (
            "2 FLOPs per multiply-add; decoder linear layers per computed token "
            "(prompt + fed-back outputs = P+O-1 per request); lm_head only for the O sampled rows; "
            "exact causal attention QK^T + PV; norms/activations/softmax and prefix-cache reuse "
            "not counted"
        ),
        "flops": {
            "loraplex_workload": workload_flops(shape, list(map(len, prompts)), lens),
            "hf_workload": workload_flops(shape, list(map(len, prompts[:hf_n])), lens[:hf_n]),
        },
        "runs": [run.to_json() for run in runs],
        "warnings": warnings,
    }
    peaks.append(measure_fp32_peak_gflops())  # again at the end: a shared machine drifts
    say(f"fp32 matmul peak again: {peaks[1]:.1f} GFLOP/s (the higher one is used)")
    result["peak_gflops_measured"] = [round(p, 2) for p in peaks]
    result["summary"] = _summarize(result, runs, max(peaks), hf_n, opts)
    if hf is not None:
        lp_last = next(r for r in reversed(runs) if r.system == "loraplex")
        hf_last = next(r for r in reversed(runs) if r.system == "hf")
        from loraplex.bench.systems import greedy_agreement

        result["greedy_agreement_vs_hf"] = greedy_agreement(lp_last.outputs, hf_last.outputs)
        del hf
        gc.collect()

    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"throughput-{time.strftime('%Y%m%d-%H%M%S')}"
    if opts.profile:
        from loraplex.bench.profile import profile_loraplex

        if not reset_prefix_cache_for(llm, opts):
            del llm
            gc.collect()
            llm = fresh_llm()
        n = min(opts.profile_requests, opts.num_requests)
        profile_path = out_dir / f"{stem}-profile.txt"
        say(f"profiling loraplex on {n} requests ...")
        print(profile_loraplex(llm, prompts[:n], lens[:n], profile_path))
        result["profile"] = {"requests": n, "table": str(profile_path)}
    del llm
    gc.collect()
    from loraplex.bench.prefix_cache import add_prefix_cache_test

    add_prefix_cache_test(result, opts, model_dir, tokenizer, say)

    json_path = out_dir / f"{stem}.json"
    print()
    print(report.summary_table(result))
    if "prefix_cache_test" in result:
        print()
        print(report.prefix_table(result["prefix_cache_test"]))
    plot_note = report.write_plot(result, out_dir / f"{stem}.png")
    result["plot"] = plot_note or str(out_dir / f"{stem}.png")
    report.write_json(result, json_path)
    print()
    print(f"results: {json_path}")
    print(f"plot: {plot_note}" if plot_note else f"plot: {out_dir / f'{stem}.png'}")
    print(f"reproduce: {opts.command_line()}")
    return result


def _summarize(
    result: dict[str, Any], runs: list[RunResult], peak: float, hf_n: int, opts: ThroughputOptions
) -> dict[str, Any]:
    def system_summary(system: str, flops: int) -> dict[str, Any] | None:
        mine = [r for r in runs if r.system == system]
        if not mine:
            return None
        rates = [r.tokens_per_s for r in mine]
        gflops = [flops / r.seconds / 1e9 for r in mine]
        median_gflops = statistics.median(gflops)
        engine = (
            {
                "prefix_cache_hit_tokens": [r.engine.get("prefix_cache_hits") for r in mine],
                "preemptions": [r.engine.get("num_preemptions") for r in mine],
            }
            if system == "loraplex"
            else {}
        )
        return {
            "requests": mine[0].num_requests,
            **engine,
            "per_repeat_tokens_per_s": [round(v, 3) for v in rates],
            "median_tokens_per_s": round(statistics.median(rates), 3),
            "per_repeat_gflops": [round(v, 3) for v in gflops],
            "median_gflops": round(median_gflops, 3),
            "mfu": round(median_gflops / peak, 5),
        }

    flops = result["flops"]
    lp = system_summary("loraplex", flops["loraplex_workload"]["total"])
    hf = system_summary("hf", flops["hf_workload"]["total"])
    if hf is not None:
        hf["extrapolated"] = hf_n < opts.num_requests
        hf["note"] = (
            f"measured on the first {hf_n} of {opts.num_requests} requests; tokens/s taken as "
            "the full workload's rate"
            if hf_n < opts.num_requests
            else "full workload"
        )
    speedup = (
        round(lp["median_tokens_per_s"] / hf["median_tokens_per_s"], 3)
        if lp and hf and hf["median_tokens_per_s"] > 0
        else None
    )
    # Repeat r of each system ran back to back, so their ratio cancels slow drift of the machine.
    paired = (
        [
            round(a / b, 3)
            for a, b in zip(
                lp["per_repeat_tokens_per_s"], hf["per_repeat_tokens_per_s"], strict=True
            )
            if b > 0
        ]
        if lp and hf
        else []
    )
    return {
        "peak_gflops": round(peak, 2),
        "loraplex": lp,
        "hf": hf,
        "speedup": speedup,
        "per_repeat_speedup": paired,
        "median_paired_speedup": round(statistics.median(paired), 3) if paired else None,
    }
