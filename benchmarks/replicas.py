"""``python -m benchmarks.replicas``: what data-parallel engine replicas buy on this machine, and what
adapter-affinity routing saves over round robin.

In one process, two ``DataParallelClient``s of supervised engine processes on the model (the
embedded SmolLM2-135M-Instruct by default): one replica on all usable CPUs, and ``--replicas``
replicas on disjoint shares of them (one core each on a 2-core machine). Prefix caching is off
in both (the timed prompts repeat from run to run). Figures are medians over ``--repeats``
paired runs that alternate which side goes first:

* **throughput**: ``loraplex bench throughput``'s workload (``--num-requests`` prompts of 20-60
  words, 16-128 output tokens, greedy, EOS ignored), all submitted at once, on the base model:
  output tokens/s of 1 replica against N replicas, and per core (tokens/s over the cores each
  side's engine threads use);
* **adapters**: the same workload spread over ``--num-adapters`` random rank-``--adapter-rank``
  adapters in a steady mix (every adapter once in each cycle of N requests, the cycles
  shuffled: a strict ``i % N`` would line up with round robin's ``i % replicas`` and hide what
  it costs), on the N replicas, routed by ``affinity`` against ``round_robin``. Each run adds
  the adapters (each is placed on one replica), runs the mix, and removes them; it reports the
  adapter loads on each replica and how many replicas each adapter was loaded on, and the
  tokens/s.

Writes ``replicas-<time>.json`` to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loraplex.argtypes import positive_int
from loraplex.bench.common import add_workload_arguments, workload_argv
from loraplex.config import MAX_LORAS

Log = Callable[[str], None]


@dataclass(frozen=True)
class ReplicasBenchOptions:
    model: str | None = None
    replicas: int = 2
    num_requests: int = 64
    min_output: int = 16
    max_output: int = 128
    min_prompt_words: int = 20
    max_prompt_words: int = 60
    num_adapters: int = 8
    adapter_rank: int = 8
    repeats: int = 3
    seed: int = 0
    skip_throughput: bool = False
    skip_adapters: bool = False
    output_dir: str = "bench-results"

    def __post_init__(self) -> None:
        checks = [
            (self.replicas >= 2, "--replicas must be at least 2 (the comparison is 1 vs N)"),
            (1 <= self.min_output <= self.max_output, "need 1 <= --min-output <= --max-output"),
            (
                1 <= self.min_prompt_words <= self.max_prompt_words,
                "need 1 <= --min-prompt-words <= --max-prompt-words",
            ),
            (
                1 <= self.num_adapters <= MAX_LORAS,
                f"--num-adapters must be in [1, {MAX_LORAS}] (each replica may hold them all)",
            ),
            (self.adapter_rank >= 1, "--adapter-rank must be at least 1"),
            (self.repeats >= 1 and self.num_requests >= 1, "--repeats and --num-requests >= 1"),
            (
                not (self.skip_throughput and self.skip_adapters),
                "--skip-throughput and --skip-adapters together leave nothing to run",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def command_line(self) -> str:
        argv = ["python", "-m", "benchmarks.replicas"] + ([self.model] if self.model else [])
        argv += [
            f"--replicas={self.replicas}",
            *workload_argv(self),
            f"--num-adapters={self.num_adapters}",
            f"--adapter-rank={self.adapter_rank}",
            f"--repeats={self.repeats}",
            f"--seed={self.seed}",
        ]
        argv += ["--skip-throughput"] if self.skip_throughput else []
        argv += ["--skip-adapters"] if self.skip_adapters else []
        return shlex.join([*argv, f"--output-dir={self.output_dir}"])


def add_replicas_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--replicas", type=positive_int, default=2, help="replicas against one")
    w = p.add_argument_group("workload (loraplex bench throughput's)")
    add_workload_arguments(w)
    w.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("adapters: affinity vs round robin")
    a.add_argument("--num-adapters", type=positive_int, default=8)
    a.add_argument("--adapter-rank", type=positive_int, default=8)
    x = p.add_argument_group("runs and output")
    x.add_argument("--repeats", type=positive_int, default=3, help="paired runs per comparison")
    x.add_argument("--skip-throughput", action="store_true")
    x.add_argument("--skip-adapters", action="store_true")
    x.add_argument("--output-dir", default="bench-results")


def options_from(args: argparse.Namespace) -> ReplicasBenchOptions:
    return ReplicasBenchOptions(
        model=args.model,
        replicas=args.replicas,
        num_requests=args.num_requests,
        min_output=args.min_output,
        max_output=args.max_output,
        min_prompt_words=args.min_prompt_words,
        max_prompt_words=args.max_prompt_words,
        num_adapters=args.num_adapters,
        adapter_rank=args.adapter_rank,
        repeats=args.repeats,
        seed=args.seed,
        skip_throughput=args.skip_throughput,
        skip_adapters=args.skip_adapters,
        output_dir=args.output_dir,
    )


def steady_mix(num_requests: int, num_adapters: int, seed: int) -> list[int]:
    """Adapter index per request: each adapter once in every cycle, cycles shuffled."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < num_requests:
        order += rng.sample(range(num_adapters), num_adapters)
    return order[:num_requests]


# ---- runs --------------------------------------------------------------------------------------


async def _timed(
    client: Any, tag: str, prompts: list[list[int]], lens: list[int], keys: list[str | None]
) -> dict[str, Any]:
    """All requests at once; output tokens/s."""
    from loraplex.sampling_params import SamplingParams

    async def one(i: int) -> int:
        params = SamplingParams(max_tokens=lens[i], temperature=0.0, ignore_eos=True)
        stream = client.generate(f"{tag}-{i}", prompts[i], params, lora_key=keys[i])
        return sum([len(d.new_token_ids) async for d in stream])

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 4), "output_tokens": tokens, "tokens_per_s": tokens / seconds}


def _replica_cpus(client: Any) -> list[list[int]]:
    return [list(r.placement.cpus) for r in client.replicas]


def _cores(client: Any) -> int:
    return sum(r.num_threads for r in client.replicas)


async def _throughput_pairs(
    single: Any, multi: Any, prompts: list[list[int]], lens: list[int], repeats: int, say: Log
) -> dict[str, Any]:
    base: list[str | None] = [None] * len(prompts)
    runs = []
    for r in range(repeats):
        order = [("one", single), ("many", multi)]
        if r % 2:
            order.reverse()
        pair: dict[str, Any] = {
            label: await _timed(c, f"tp{r}{label}", prompts, lens, base) for label, c in order
        }
        for label, c in order:
            pair[label]["tokens_per_s_per_core"] = pair[label]["tokens_per_s"] / _cores(c)
        pair["ratio"] = pair["many"]["tokens_per_s"] / pair["one"]["tokens_per_s"]
        pair["first"] = order[0][0]
        runs.append(pair)
        say(
            f"throughput pair {r + 1}/{repeats}: 1 replica {pair['one']['tokens_per_s']:.1f} "
            f"tok/s, {len(multi.replicas)} replicas {pair['many']['tokens_per_s']:.1f} tok/s, "
            f"ratio {pair['ratio']:.3f}"
        )
    med = statistics.median
    return {
        "cores_one": _cores(single),
        "cores_many": _cores(multi),
        "tokens_per_s_one": med([p["one"]["tokens_per_s"] for p in runs]),
        "tokens_per_s_many": med([p["many"]["tokens_per_s"] for p in runs]),
        "tokens_per_s_per_core_one": med([p["one"]["tokens_per_s_per_core"] for p in runs]),
        "tokens_per_s_per_core_many": med([p["many"]["tokens_per_s_per_core"] for p in runs]),
        "ratio": med([p["ratio"] for p in runs]),
        "runs": runs,
    }


async def _adapter_run(
    client: Any,
    policy: str,
    tag: str,
    adapters: dict[str, str],
    prompts: list[list[int]],
    lens: list[int],
    mix: list[int],
) -> dict[str, Any]:
    """Add the adapters, run the mix under ``policy``, remove them; the loads of this run."""
    client.set_routing(policy)
    before = [dict(c) for c in client.adapter_loads]
    keys = [(await client.add_lora(name, path)).key for name, path in adapters.items()]
    run = await _timed(client, tag, prompts, lens, [keys[k] for k in mix])
    for key in keys:
        await client.remove_lora(key)
    loads = [
        {k: n - old.get(k, 0) for k, n in now.items() if n > old.get(k, 0)}
        for now, old in zip(client.adapter_loads, before, strict=True)
    ]
    on = [sum(1 for per in loads if key in per) for key in keys]
    run["adapter_loads_per_replica"] = [sum(per.values()) for per in loads]
    run["replicas_per_adapter"] = on
    run["adapters_on_more_than_one_replica"] = sum(1 for n in on if n > 1)
    spills = getattr(client.router, "spills", None)
    if spills is not None:
        run["spills"] = spills
    return run


async def _adapter_pairs(
    multi: Any,
    adapters: dict[str, str],
    prompts: list[list[int]],
    lens: list[int],
    mix: list[int],
    repeats: int,
    say: Log,
) -> dict[str, Any]:
    runs = []
    for r in range(repeats):
        order = ["affinity", "round_robin"]
        if r % 2:
            order.reverse()
        pair: dict[str, Any] = {
            p: await _adapter_run(multi, p, f"ad{r}{p}", adapters, prompts, lens, mix)
            for p in order
        }
        pair["ratio"] = pair["affinity"]["tokens_per_s"] / pair["round_robin"]["tokens_per_s"]
        pair["first"] = order[0]
        runs.append(pair)
        say(
            f"adapters pair {r + 1}/{repeats}: affinity {pair['affinity']['tokens_per_s']:.1f} "
            f"tok/s, loads {pair['affinity']['adapter_loads_per_replica']}; round robin "
            f"{pair['round_robin']['tokens_per_s']:.1f} tok/s, loads "
            f"{pair['round_robin']['adapter_loads_per_replica']}"
        )
    med = statistics.median
    out: dict[str, Any] = {}
    for p in ("affinity", "round_robin"):
        out[f"tokens_per_s_{p}"] = med([run[p]["tokens_per_s"] for run in runs])
        out[f"adapter_loads_{p}"] = med([sum(run[p]["adapter_loads_per_replica"]) for run in runs])
        out[f"adapters_on_more_than_one_replica_{p}"] = max(
            run[p]["adapters_on_more_than_one_replica"] for run in runs
        )
    out["ratio"] = med([run["ratio"] for run in runs])
    out["runs"] = runs
    return out


def _say(message: str) -> None:
    print(message, flush=True)


def run_replicas(opts: ReplicasBenchOptions, say: Log = _say) -> dict[str, Any]:
    return asyncio.run(_main(opts, say))


async def _main(opts: ReplicasBenchOptions, say: Log) -> dict[str, Any]:
    from loraplex.bench.adapters import make_random_adapters
    from loraplex.bench.common import ThroughputOptions, load_throughput_workload, machine
    from loraplex.engine.dp_client import DataParallelClient
    from loraplex.engine_args import engine_config

    loaded = load_throughput_workload(
        ThroughputOptions(
            model=opts.model,
            num_requests=opts.num_requests,
            min_output=opts.min_output,
            max_output=opts.max_output,
            min_prompt_words=opts.min_prompt_words,
            max_prompt_words=opts.max_prompt_words,
            seed=opts.seed,
        )
    )
    model_dir, prompts, lens = loaded.model_dir, loaded.prompts, loaded.output_lens
    config = engine_config(
        model_dir,
        enable_prefix_caching=False,
        max_loras=opts.num_adapters,
        max_lora_rank=max(opts.adapter_rank, 8),
        max_cpu_loras=max(opts.num_adapters, 16),
    )
    single = DataParallelClient.of_processes(config, model_dir, 1)
    multi = DataParallelClient.of_processes(config, model_dir, opts.replicas)
    result: dict[str, Any] = {
        "benchmark": "replicas",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": opts.model or "embedded:SmolLM2-135M-Instruct",
        "options": asdict(opts),
        "command": opts.command_line(),
        "machine": machine(),
    }
    await asyncio.gather(single.start(), multi.start())
    try:
        result["replica_cpus"] = {"one": _replica_cpus(single), "many": _replica_cpus(multi)}
        warm = min(4, len(prompts))
        for client in (single, multi):  # first steps allocate: not timed
            await _timed(client, "warm", prompts[:warm], [4] * warm, [None] * warm)
        if not opts.skip_throughput:
            result["throughput"] = await _throughput_pairs(
                single, multi, prompts, lens, opts.repeats, say
            )
        if not opts.skip_adapters:
            with tempfile.TemporaryDirectory(prefix="loraplex-bench-replicas-") as tmp:
                adapters = make_random_adapters(
                    model_dir, Path(tmp), opts.num_adapters, rank=opts.adapter_rank,
                    seed=opts.seed,
                )  # fmt: skip
                mix = steady_mix(len(prompts), opts.num_adapters, opts.seed)
                result["adapters"] = await _adapter_pairs(
                    multi, adapters, prompts, lens, mix, opts.repeats, say
                )
    finally:
        await asyncio.gather(single.shutdown(timeout=2.0), multi.shutdown(timeout=2.0))
    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"replicas-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    if "throughput" in result:
        t = result["throughput"]
        say(
            f"throughput: 1 replica ({t['cores_one']} cores) {t['tokens_per_s_one']:.1f} tok/s, "
            f"{opts.replicas} replicas ({t['cores_many']} cores) {t['tokens_per_s_many']:.1f} "
            f"tok/s, ratio {t['ratio']:.3f}; per core {t['tokens_per_s_per_core_one']:.1f} vs "
            f"{t['tokens_per_s_per_core_many']:.1f}"
        )
    if "adapters" in result:
        a = result["adapters"]
        say(
            f"adapters: affinity {a['tokens_per_s_affinity']:.1f} tok/s with "
            f"{a['adapter_loads_affinity']:g} loads, round robin "
            f"{a['tokens_per_s_round_robin']:.1f} tok/s with {a['adapter_loads_round_robin']:g} "
            f"loads (median per run); ratio {a['ratio']:.3f}"
        )
    say(f"results: {path}")
    return result


DESCRIPTION = (
    "In one process, one engine replica on all CPUs against --replicas replicas on disjoint "
    "shares of them: output tokens/s (and per core) on bench throughput's workload; then the "
    "workload over --num-adapters random adapters in a steady mix, routed by affinity against "
    "round robin: adapter loads per replica and tokens/s. Paired alternating runs, medians. "
    "Writes JSON to --output-dir."
)


def _main_run(args: argparse.Namespace) -> int:
    run_replicas(options_from(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import run_main

    return run_main("replicas", DESCRIPTION, add_replicas_arguments, _main_run, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
