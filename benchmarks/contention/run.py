"""``python -m benchmarks.contention``: throughput and step times quiet and beside busy processes, one
child process per OpenMP spin setting, and batch 1 against the memory-bandwidth bound (issue 20).

* **Runs.** ``workload``: the 64-request mix of ``loraplex bench throughput`` (same seed, same
  token ids, greedy, ``ignore_eos``; with ``--num-adapters N`` request i on adapter i % N).
  ``batch1``: one request asked to copy a passage, ``--batch1-tokens`` output tokens, always on
  the base model. Each run goes once quiet and once with each ``--busy`` count of competing
  processes (separate Pythons spinning ``while True: pass``, started before the timed run and
  killed after it).
* **Children.** GNU OpenMP reads its wait policy once, when torch loads, so each spin setting is
  its own loraplex child (``child``; ``LORAPLEX_OMP_SPINCOUNT`` in its environment),
  which builds and warms up one engine and then runs what the parent asks. With
  ``--vllm-python`` one vLLM child (``worker`` run by that Python, vLLM's ``LLM``,
  ``VLLM_CPU_KVCACHE_SPACE=2``, its own OpenMP defaults) gets the same token ids. Both time
  each ``llm_engine.step()`` of their offline loop with the same code.
* **Pairing.** For each setting and repeat r the busy counts run in order on even r and reversed
  on odd r, and within each busy count the systems likewise; ratios busy/quiet and
  loraplex/vLLM are taken within a repeat (runs close in time), and the worst pair is quoted.
* **Bandwidth bound.** Each loraplex child measures a ``--copy-mb`` torch copy (best of 5,
  bytes read + written) quiet when it starts and before it exits; the best is the copy
  bandwidth. Weight bytes per token: every parameter of the engine's model once (tied
  embeddings once). Batch-1 decode tokens/s (its steps after the prefill) is quoted as a
  fraction of bandwidth / weight bytes.

Writes ``contention-<time>.json`` and ``.md`` to ``--output-dir`` (the JSON after every spin
setting too, so a long run keeps what it measured).
"""

from __future__ import annotations

import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.contention.options import ContentionOptions, Scenario
from benchmarks.contention.procs import (
    Child,
    ChildError,
    busy_processes,
    frozen,
    loraplex_env,
    vllm_env,
)
from benchmarks.contention.summary import summarize, warnings
from benchmarks.contention.worker import tree_cpu_seconds
from benchmarks.vllm_dtype import resolve_vllm_dtype
from loraplex.bench.workload import encode, make_workload, random_text
from loraplex.cpu_threads import DEFAULT_SPINCOUNT, SPIN_ENV

Log = Callable[[str], None]
VLLM_KV_CACHE_GB = 2
COPY_INSTRUCTION = "Copy the following passage exactly, word for word:\n\n"


def run_contention(opts: ContentionOptions, log: Log | None = None) -> dict[str, Any]:
    say: Log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    with _terminate_cleanly(), tempfile.TemporaryDirectory(prefix="loraplex-contention-") as tmp:
        return _run(opts, say, Path(tmp))


@contextmanager
def _terminate_cleanly() -> Iterator[None]:
    """SIGTERM (``timeout``, ``kill``) unwinds like Ctrl-C, so the busy processes and the
    children are ended on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def build_spec(
    opts: ContentionOptions, model_dir: str, tokenizer: Any, adapter_dirs: dict[str, str]
) -> dict[str, Any]:
    """What every child reads: the model, the engines' settings and each scenario's token ids,
    output lengths and adapter indices (None: the base model)."""
    vllm_dtype, why = resolve_vllm_dtype(opts.vllm_dtype)
    workload = make_workload(
        opts.num_requests,
        opts.min_output,
        opts.max_output,
        min_words=opts.min_prompt_words,
        max_words=opts.max_prompt_words,
        seed=opts.seed,
    )
    n = opts.num_adapters
    passage = random_text(random.Random(f"contention-batch1:{opts.seed}"), opts.batch1_words)
    scenarios: dict[str, dict[str, Any]] = {
        "workload": {
            "prompts": [encode(tokenizer, p, chat=opts.chat) for p in workload.prompts],
            "output_lens": workload.output_lens,
            "adapters": [i % n if n else None for i in range(opts.num_requests)],
        },
        "batch1": {
            "prompts": [encode(tokenizer, COPY_INSTRUCTION + passage, chat=opts.chat)],
            "output_lens": [opts.batch1_tokens],
            "adapters": [None],
        },
    }
    warm = [
        encode(tokenizer, p, chat=opts.chat)
        for p in make_workload(4, 4, 4, seed=opts.seed + 1_000_003).prompts
    ]  # never the timed prompts (they would be cached); then one request per adapter
    warm_adapters: list[int | None] = [None] * len(warm) + list(range(n))
    return {
        "model_dir": model_dir,
        "threads": opts.threads,
        "adapters": [{"name": k, "path": v} for k, v in adapter_dirs.items()],
        "loraplex_engine": {"max_loras": n, "max_lora_rank": opts.adapter_rank} if n else {},
        "vllm": {"dtype": vllm_dtype, "dtype_reason": why, "max_lora_rank": opts.adapter_rank},
        "warm": {
            "prompts": [warm[i % len(warm)] for i in range(len(warm_adapters))],
            "output_lens": [4] * len(warm_adapters),
            "adapters": warm_adapters,
        },
        "scenarios": {s: scenarios[s] for s in opts.scenarios},
    }


def run_order(
    opts: ContentionOptions, systems: Sequence[str]
) -> list[tuple[Scenario, int, int, str]]:
    """(scenario, repeat, busy, system) in run order for one spin setting: busy counts forward
    on even repeats and reversed on odd ones, and the systems likewise within each."""
    order: list[tuple[Scenario, int, int, str]] = []
    for scenario in opts.scenarios:
        for r in range(opts.repeats):
            flip = r % 2 == 1
            for busy in reversed(opts.busy) if flip else opts.busy:
                for system in reversed(systems) if flip else systems:
                    order.append((scenario, r, busy, system))
    return order


def vllm_script(dest_dir: Path) -> Path:
    """The vLLM child, copied out of the package (run from there, the package's own modules
    cannot shadow the standard library's in vLLM's Python)."""
    src = Path(__file__).with_name("worker.py")
    dest = dest_dir / "loraplex_contention_vllm.py"
    shutil.copyfile(src, dest)
    return dest


def vllm_argv(opts: ContentionOptions, script: Path, spec: Path) -> list[str]:
    if opts.vllm_python is None:
        raise ValueError("no --vllm-python given")
    return [opts.vllm_python, str(script), str(spec)]


def loraplex_argv(spec: Path) -> list[str]:
    # The child imports ``benchmarks``: put the repository root first on its path, whatever its cwd.
    root = str(Path(__file__).resolve().parents[2])
    boot = f"import runpy, sys; sys.path.insert(0, {root!r}); "
    boot += "runpy.run_module('benchmarks.contention.child', run_name='__main__')"
    return [sys.executable, "-c", boot, str(spec)]


def _run(opts: ContentionOptions, say: Log, tmp: Path) -> dict[str, Any]:
    import os

    from loraplex.bench.common import load_tokenizer_and_config, machine
    from loraplex.bench.report import write_json
    from loraplex.engine.default_model import resolve_model_dir

    model_dir = resolve_model_dir(opts.model)
    tokenizer, _ = load_tokenizer_and_config(model_dir)
    adapter_dirs: dict[str, str] = {}
    if opts.num_adapters:
        from loraplex.bench.adapters import make_random_adapters

        adapter_dirs = make_random_adapters(
            model_dir, tmp / "adapters", opts.num_adapters, rank=opts.adapter_rank, seed=opts.seed
        )
    spec = build_spec(opts, model_dir, tokenizer, adapter_dirs)
    spec_path = tmp / "spec.json"
    write_json(spec, spec_path)
    systems = ["loraplex"] + (["vllm"] if opts.vllm_python else [])
    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"contention-{time.strftime('%Y%m%d-%H%M%S')}"
    say(f"model: {model_dir}; systems: {', '.join(systems)}; spin settings: "
        f"{', '.join(opts.spincounts)}; busy: {','.join(map(str, opts.busy))}")  # fmt: skip
    runs: list[dict[str, Any]] = []
    outputs: dict[tuple[str, str, str, int, int], list[list[int]]] = {}
    result: dict[str, Any] = {
        "benchmark": "contention",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": opts.command_line(),
        "options": {**asdict(opts), "model": opts.model or "embedded:SmolLM2-135M-Instruct"},
        "machine": machine(),
        "model_dir": model_dir,
        "workload": _workload_json(spec),
        "engine_default_spincount": DEFAULT_SPINCOUNT,
        "child_env_rule": f"loraplex children: the parent's GOMP_SPINCOUNT and OMP_WAIT_POLICY "
        f"dropped, {SPIN_ENV}=<setting> (or OMP_WAIT_POLICY=passive); vLLM: GOMP_SPINCOUNT "
        f"dropped (its runtime's defaults), VLLM_CPU_KVCACHE_SPACE={VLLM_KV_CACHE_GB}",
        "busy_process": "python -S -c 'while True: pass' (killed by the kernel if this process "
        "dies), one per count, started (and running its loop) before the timed run, killed "
        "after it",
        "step_time_rule": "wall time of each llm_engine.step() call of the offline generate "
        "loop (vLLM's step() waits for its engine-core process's next output)",
        "complete": False,
        "children": [],
        "bandwidth_probes": [],
        "runs": runs,
        "warnings": [],
    }
    children: list[Child] = []

    def start(name: str, argv: list[str], env: dict[str, str], stack: ExitStack) -> Child:
        t0 = time.perf_counter()
        child = Child(name, argv, env, tmp / f"{name.replace(' ', '-')}.log", opts.timeout_s)
        children.append(child)
        stack.callback(child.close)
        ready = child.expect("ready")
        ready.pop("event")
        result["children"].append({"name": name, **ready})
        # Each scenario once, untimed, at full size: an engine's first full-size run pays
        # one-time costs (allocator growth, first-touch of KV pages) that would land on
        # whichever system ran first (measured: loraplex's first workload run 376 tok/s, its
        # second 423).
        for scenario in opts.scenarios:
            child.call("run", "result", scenario=scenario)
        say(
            f"{name}: built, warmed up and each scenario run once untimed in "
            f"{time.perf_counter() - t0:.1f} s (pid {child.pid})"
        )
        return child

    try:
        with ExitStack() as stack:
            vllm = None
            if opts.vllm_python:
                env = vllm_env(os.environ, SPIN_ENV, VLLM_KV_CACHE_GB)
                vllm = start("vllm", vllm_argv(opts, vllm_script(tmp), spec_path), env, stack)
            for spin in opts.spincounts:
                env = loraplex_env(spin, os.environ, SPIN_ENV)
                lp = start(f"loraplex spin={spin}", loraplex_argv(spec_path), env, stack)
                probe = "batch1" in opts.scenarios
                if probe:
                    _probe(lp, spin, opts, result)
                for scenario, r, busy, system in run_order(opts, systems):
                    child = lp if system == "loraplex" else vllm
                    assert child is not None
                    idle = [c for c in (lp, vllm) if c is not None and c is not child]
                    run = _one_run(child, scenario, busy, idle)
                    outputs[(system, spin, scenario, r, busy)] = run.pop("outputs")
                    runs.append({"system": system, "spin": spin, "repeat": r, **run})
                    say(_line(runs[-1], opts.repeats))
                if probe:
                    _probe(lp, spin, opts, result)
                lp.close()
                result["summary"] = summarize(runs, outputs, opts, result)
                write_json(result, stem.with_suffix(".json"))
    except ChildError as exc:
        failed = [c for c in children if c.proc.returncode not in (None, 0)] or children[-1:]
        kept = [c.keep_log(Path(f"{stem}-{c.log.name}")) for c in failed]
        raise ChildError(f"{exc} (log: {', '.join(map(str, kept))})") from None
    result["complete"] = True
    result["summary"] = summarize(runs, outputs, opts, result)
    result["warnings"] = warnings(runs)
    from benchmarks.contention.report import markdown

    table = markdown(result)
    stem.with_suffix(".md").write_text(table + "\n")
    result["markdown"] = str(stem.with_suffix(".md"))
    write_json(result, stem.with_suffix(".json"))
    print(table)
    print()
    print(f"results: {stem.with_suffix('.json')}")
    print(f"table: {stem.with_suffix('.md')}")
    print(f"reproduce: {opts.command_line()}")
    return result


def _workload_json(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        name: {
            "num_requests": len(s["prompts"]),
            "prompt_tokens": [len(p) for p in s["prompts"]],
            "output_lens": s["output_lens"],
            "total_output_tokens": sum(s["output_lens"]),
            "adapters": s["adapters"],
        }
        for name, s in spec["scenarios"].items()
    }


def _probe(child: Child, spin: str, opts: ContentionOptions, result: dict[str, Any]) -> None:
    probe = child.call("bandwidth", "bandwidth", mb=opts.copy_mb)
    probe.pop("event")
    result["bandwidth_probes"].append({"child": child.name, "spin": spin, **probe})


def _one_run(child: Child, scenario: str, busy: int, idle: Sequence[Child]) -> dict[str, Any]:
    """One timed run beside ``busy`` busy processes; ``idle``: the other children, stopped for
    the run (``frozen``); their CPU time over it is recorded (it must be 0)."""
    with busy_processes(busy) as procs, frozen([c.pid for c in idle]):
        idle0 = sum(tree_cpu_seconds(c.pid) for c in idle)
        run = child.call("run", "result", scenario=scenario)
        idle_cpu = sum(tree_cpu_seconds(c.pid) for c in idle) - idle0
        alive = all(p.poll() is None for p in procs)  # they competed for the whole run
    run.pop("event")
    return {
        "scenario": scenario,
        "busy": busy,
        "busy_pids": [p.pid for p in procs],
        "busy_ran_throughout": alive,
        **run,
        "idle_children_cpu_s": round(idle_cpu, 3),
    }


def _line(run: dict[str, Any], repeats: int) -> str:
    steps = run["steps"] or {}
    return (
        f"{run['scenario']:8s} spin={run['spin']:>7s} repeat {run['repeat'] + 1}/{repeats} "
        f"busy={run['busy']} {run['system']:8s}: {run['output_tokens']} tokens in "
        f"{run['seconds']:.2f} s = {run['tokens_per_s']:.1f} tok/s; step p50/p99 "
        f"{steps.get('p50_ms', float('nan')):.1f}/{steps.get('p99_ms', float('nan')):.1f} ms, "
        f"cpu/wall {run['cpu_per_wall']}"
    )
