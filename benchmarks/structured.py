"""``python -m benchmarks.structured``: what a JSON-schema constraint costs per output token, and a
step-time trace showing that a slow compile stalls no one.

On one model (the embedded SmolLM2-135M-Instruct by default), in one process:

* **TPOT**: batches of B requests (B = 1 and 32 by default), unconstrained (``ignore_eos``) or
  constrained by a JSON schema whose outputs are longer than ``--max-tokens`` (so both run the
  same number of tokens), in paired runs that alternate which goes first, greedy. A request's
  time per output token is (its last token's time - its first token's) / (tokens - 1); a run's
  value is the median over its requests; the figure is the median over ``--repeats`` pairs of
  the ratio constrained / unconstrained (target: at most 1.3 at every batch size), beside the
  median TPOT of each kind.
* **compile trace**: ``--trace-batch`` unconstrained requests decode; after a few steps a
  request arrives with a large schema whose compile is held to at least
  ``--slow-compile-seconds`` (a hook around the real compile). Every step's duration is
  recorded, with the slow request's state (compiling, running, done): steps go on at their
  usual pace while it compiles.

Writes ``structured-<time>.json`` to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.argtypes import positive_int
from loraplex.sampling_params import SamplingParams, StructuredOutputsParams

Log = Callable[[str], None]

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 40},
        "items": {
            "type": "array",
            "minItems": 8,
            "maxItems": 12,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "name": {"type": "string", "maxLength": 30},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 20},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "name", "qty", "price"],
                "additionalProperties": False,
            },
        },
        "notes": {"type": "string", "maxLength": 80},
    },
    "required": ["customer", "items", "notes"],
    "additionalProperties": False,
}
TOPICS = [
    "a bakery",
    "a hardware store",
    "a bookshop",
    "a florist",
    "a bike shop",
    "a pharmacy",
    "a toy store",
    "a grocery",
]
SLOW_MARK = "slow-compile"  # in the trace schema's description: the hook holds its compile


def big_schema(num_fields: int = 200) -> dict[str, Any]:
    """A large form: many fields with patterns, enums and bounds (a slow compile for real)."""
    props: dict[str, Any] = {}
    for i in range(num_fields):
        kind = i % 4
        if kind == 0:
            props[f"code_{i}"] = {"type": "string", "pattern": f"^[A-Z]{{2}}{i % 7}-[0-9]{{3,5}}$"}
        elif kind == 1:
            props[f"choice_{i}"] = {"enum": [f"option-{i}-{j}" for j in range(12)]}
        elif kind == 2:
            props[f"amount_{i}"] = {"type": "integer", "minimum": i, "maximum": 1000 + i}
        else:
            props[f"note_{i}"] = {"type": "string", "minLength": 2, "maxLength": 20 + i % 9}
    return {
        "type": "object",
        "description": SLOW_MARK,
        "properties": props,
        "required": list(props)[:6],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class StructuredBenchOptions:
    model: str | None = None
    batch_sizes: tuple[int, ...] = (1, 32)
    max_tokens: int = 64
    repeats: int = 3
    trace_batch: int = 8
    trace_tokens: int = 120
    slow_compile_seconds: float = 2.0
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    max_model_len: int = 1024
    output_dir: str = "bench-results"

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("--batch-sizes must be positive integers, e.g. 1,32")
        if self.max_tokens < 8:
            raise ValueError("--max-tokens must be at least 8")
        if self.slow_compile_seconds < 0:
            raise ValueError("--slow-compile-seconds must be 0 or more")


def add_structured_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated (default 1,32)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="output tokens per request")
    p.add_argument("--repeats", type=positive_int, default=3, help="paired runs per batch size")
    p.add_argument("--trace-batch", type=positive_int, default=8)
    p.add_argument("--trace-tokens", type=positive_int, default=120)
    p.add_argument("--slow-compile-seconds", type=float, default=2.0)
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads (default: torch's; 1 gives steadier figures on a busy machine)",
    )
    p.add_argument("--output-dir", default="bench-results")


def options_from(args: argparse.Namespace) -> StructuredBenchOptions:
    try:
        sizes = tuple(int(s) for s in str(args.batch_sizes).split(",") if s.strip())
    except ValueError:
        raise ValueError(
            f"--batch-sizes must be integers like 1,32; got {args.batch_sizes!r}"
        ) from None
    return StructuredBenchOptions(
        model=args.model,
        batch_sizes=sizes,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        trace_batch=args.trace_batch,
        trace_tokens=args.trace_tokens,
        slow_compile_seconds=args.slow_compile_seconds,
        threads=args.threads,
        output_dir=args.output_dir,
    )


# ---- driving the engine one step at a time ----------------------------------------------------


def _prompts(tokenizer: Any, n: int, offset: int = 0) -> list[str]:
    out = []
    for i in range(n):
        topic = TOPICS[(i + offset) % len(TOPICS)]
        ask = f"Write order #{i + offset} for {topic} as JSON: customer, items, notes."
        if getattr(tokenizer, "chat_template", None):
            ask = tokenizer.apply_chat_template(
                [{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True
            )
        out.append(ask)
    return out


def _run_batch(engine: Any, prompts: list[str], params: SamplingParams, tag: str) -> dict[str, Any]:
    """Run the requests to the end; per request: first and last token times and counts."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    finish: dict[str, str | None] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            if n != counts.get(out.request_id, 0):
                last[out.request_id] = now
                counts[out.request_id] = n
            if out.finished:
                finish[out.request_id] = out.outputs[0].finish_reason
    tpot = [
        (last[r] - first[r]) / (counts[r] - 1) for r in ids if counts.get(r, 0) > 1 and r in first
    ]
    return {
        "tpot_ms": statistics.median(tpot) * 1e3,
        "tokens": [counts.get(r, 0) for r in ids],
        "finish_reasons": sorted({str(finish.get(r)) for r in ids}),
    }


def measure_tpot(llm: Any, opts: StructuredBenchOptions, say: Log) -> dict[str, Any]:
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    constraint = StructuredOutputsParams(json=ORDER_SCHEMA)
    engine.check_constraint(constraint)  # compiled once, before any timed run
    modes = {
        "unconstrained": SamplingParams(
            max_tokens=opts.max_tokens, temperature=0.0, ignore_eos=True
        ),
        "constrained": SamplingParams(
            max_tokens=opts.max_tokens, temperature=0.0, structured_outputs=constraint
        ),
    }
    result: dict[str, Any] = {}
    for batch in opts.batch_sizes:
        prompts = _prompts(tokenizer, batch)
        for mode, params in modes.items():  # warm-up, untimed
            _run_batch(engine, prompts[: min(batch, 4)], params, f"warm-{mode}-{batch}")
        runs: dict[str, list[float]] = {m: [] for m in modes}
        pairs: list[float] = []
        detail: list[dict[str, Any]] = []
        for rep in range(opts.repeats):
            order = list(modes) if rep % 2 == 0 else list(reversed(modes))
            got: dict[str, dict[str, Any]] = {}
            for mode in order:
                llm.reset_prefix_cache()
                got[mode] = _run_batch(engine, prompts, modes[mode], f"{mode}-{batch}-{rep}")
                runs[mode].append(got[mode]["tpot_ms"])
            pairs.append(got["constrained"]["tpot_ms"] / got["unconstrained"]["tpot_ms"])
            detail.append({"order": order, **{m: got[m] for m in modes}})
            say(
                f"batch {batch} repeat {rep}: unconstrained {got['unconstrained']['tpot_ms']:.2f} "
                f"ms/token, constrained {got['constrained']['tpot_ms']:.2f} ms/token"
            )
        med = {m: statistics.median(v) for m, v in runs.items()}
        result[f"batch{batch}"] = {
            "tpot_ms_unconstrained": round(med["unconstrained"], 3),
            "tpot_ms_constrained": round(med["constrained"], 3),
            # the figure: the median of the paired runs' ratios (a pair shares the machine's
            # load, which on a shared CPU moves more than the constraint does)
            "ratio": round(statistics.median(pairs), 3),
            "ratio_of_medians": round(med["constrained"] / med["unconstrained"], 3),
            "pair_ratios": [round(r, 3) for r in pairs],
            "runs": detail,
        }
    return result


class _HeldCompile:
    """Wraps the engine's grammar backend: a constraint marked ``SLOW_MARK`` takes at least
    ``seconds`` to compile (its real compile, then a sleep for the rest)."""

    def __init__(self, inner: Any, seconds: float) -> None:
        self.inner = inner
        self.name = f"{inner.name}+held"
        self.vocab_size = inner.vocab_size
        self.seconds = seconds
        self.real_compile_s: float | None = None

    def compile(self, constraint: StructuredOutputsParams) -> Any:
        start = time.perf_counter()
        compiled = self.inner.compile(constraint)
        if SLOW_MARK in constraint.key():
            self.real_compile_s = time.perf_counter() - start
            time.sleep(max(self.seconds - self.real_compile_s, 0.0))
        return compiled

    def fill_bitmasks(self, matchers: Any, bitmask: Any) -> None:
        self.inner.fill_bitmasks(matchers, bitmask)


def compile_trace(llm: Any, opts: StructuredBenchOptions, say: Log) -> dict[str, Any]:
    """``llm``: a fresh ``LLM`` (its grammar backend not built yet: the hook goes around it)."""
    engine = llm.llm_engine
    core = engine.core
    held: list[_HeldCompile] = []

    def hold(backend: Any) -> Any:
        held.append(_HeldCompile(backend, opts.slow_compile_seconds))
        return held[-1]

    core.structured.wrap_backend(hold)
    tokenizer = llm.get_tokenizer()
    engine.check_constraint(StructuredOutputsParams(json={"type": "object"}))  # backend built
    fast = SamplingParams(max_tokens=opts.trace_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(_prompts(tokenizer, opts.trace_batch, offset=100)):
        engine.add_request(f"trace-{i}", prompt, fast)
    slow = SamplingParams(
        max_tokens=512,  # room for the form: its output is checked as JSON
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=big_schema()),
    )
    steps: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    added = False
    slow_done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        if len(steps) == 5:
            added = True
            engine.add_request("slow", _prompts(tokenizer, 1, offset=7)[0], slow)
        start = time.perf_counter()
        outs = engine.step()
        end = time.perf_counter()
        state = "absent"
        if added:
            if core.structured.is_waiting("slow"):
                state = "compiling"
            elif "slow" in core.scheduler.requests:
                state = "running"
            else:
                state = "done"
        steps.append(
            {
                "t_ms": round((start - t0) * 1e3, 2),
                "step_ms": round((end - start) * 1e3, 2),
                "running": core.scheduler.num_running,
                "slow_request": state,
            }
        )
        for out in outs:
            if out.request_id == "slow" and out.finished:
                sample = out.outputs[0]
                slow_done = {
                    "finish_reason": sample.finish_reason,
                    "tokens": len(sample.token_ids),
                    "valid_json": _is_json(sample.text),
                    "time_to_first_token_s": out.metrics.get("time_to_first_token"),
                }
    by_state: dict[str, list[float]] = {}
    for s in steps:
        by_state.setdefault(s["slow_request"], []).append(s["step_ms"])
    real = held[0].real_compile_s if held else None
    compiling = by_state.get("compiling", [])
    before = by_state.get("absent", [])
    after = by_state.get("running", [])

    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 2) if values else None

    summary = {
        "slow_compile_real_s": None if real is None else round(real, 3),
        "slow_compile_held_s": opts.slow_compile_seconds,
        "steps_while_compiling": len(compiling),
        "step_ms_median_before": med(before),
        "step_ms_median_while_compiling": med(compiling),
        "step_ms_max_while_compiling": round(max(compiling), 2) if compiling else None,
        "step_ms_median_with_the_slow_request_running": med(after),
        "slow_request": slow_done,
        "engine_compiles": core.structured.num_compiles,
        "engine_compile_seconds": round(core.structured.compile_seconds, 3),
    }
    say(
        f"trace: {len(compiling)} steps ran while the slow schema compiled (median "
        f"{summary['step_ms_median_while_compiling']} ms, max "
        f"{summary['step_ms_max_while_compiling']} ms; before: "
        f"{summary['step_ms_median_before']} ms); its real compile took "
        f"{summary['slow_compile_real_s']} s"
    )
    return {"summary": summary, "steps": steps}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _say(message: str) -> None:
    print(message, flush=True)


def run_structured(opts: StructuredBenchOptions, say: Log = _say) -> dict[str, Any]:
    import torch

    from loraplex.bench.common import machine
    from loraplex.llm import LLM

    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    max_seqs = max(max(opts.batch_sizes), opts.trace_batch + 1)

    def fresh() -> Any:
        return LLM(opts.model, max_num_seqs=max_seqs, max_model_len=opts.max_model_len)

    llm = fresh()
    result: dict[str, Any] = {
        "benchmark": "structured",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": opts.model or "embedded:SmolLM2-135M-Instruct",
        "options": {
            "batch_sizes": list(opts.batch_sizes),
            "max_tokens": opts.max_tokens,
            "repeats": opts.repeats,
            "trace_batch": opts.trace_batch,
            "trace_tokens": opts.trace_tokens,
            "slow_compile_seconds": opts.slow_compile_seconds,
            "threads": opts.threads,
        },
        "backend": "llguidance",
        "machine": machine(),
        "schema": ORDER_SCHEMA,
    }
    result["tpot"] = measure_tpot(llm, opts, say)
    result["target_ratio"] = 1.3
    result["meets_target"] = all(v["ratio"] <= 1.3 for v in result["tpot"].values())
    del llm
    gc.collect()
    result["compile_trace"] = compile_trace(fresh(), opts, say)
    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for key, v in result["tpot"].items():
        say(
            f"{key}: TPOT unconstrained {v['tpot_ms_unconstrained']:.2f} ms, constrained "
            f"{v['tpot_ms_constrained']:.2f} ms, ratio {v['ratio']:.3f}"
        )
    say(f"results: {path}")
    return result


DESCRIPTION = (
    "On the model (offline LLM, one process): time per output token of requests constrained "
    "by a JSON schema against unconstrained ones at each batch size, in paired alternating "
    "runs (median), and a step-time trace while a slow schema compiles (other requests' steps "
    "go on). Writes JSON to --output-dir."
)


def _main_run(args: argparse.Namespace) -> int:
    run_structured(options_from(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import run_main

    return run_main("structured", DESCRIPTION, add_structured_arguments, _main_run, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
