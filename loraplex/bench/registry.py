"""The ``loraplex bench`` commands: one table, name -> flags and runner. Building the parser
imports only the light ``*_options`` modules (no httpx, no torch); a runner imports its bench
when it runs. Acceptance experiments of past changes are not here: they live in the repository's
``benchmarks/`` (``python -m benchmarks.<name>``, see benchmarks/README.md)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.bench.fairness_options import add_fairness_arguments
from loraplex.bench.throughput_options import add_throughput_arguments


@dataclass(frozen=True)
class Bench:
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]  # returns the exit code


def _throughput(args: argparse.Namespace) -> int:
    from loraplex.bench.throughput import run_throughput
    from loraplex.bench.throughput_options import options_from

    run_throughput(options_from(args))
    return 0


def _fairness(args: argparse.Namespace) -> int:
    from loraplex.bench.fairness import run_fairness
    from loraplex.bench.fairness_options import options_from

    run_fairness(options_from(args))
    return 0


BENCHES: dict[str, Bench] = {
    "throughput": Bench(
        "loraplex vs Hugging Face generate() (or PEFT, with adapters) on one workload",
        "Run one seeded workload through loraplex and through Hugging Face generate() in the "
        "same process, alternating, and report the ratio of median output tokens/s, the "
        "achieved GFLOP/s and MFU against the fp32 matmul peak measured in the same run. "
        "With --num-adapters N the workload uses N random LoRA adapters and the baselines "
        "are PEFT per-adapter and mixed-adapter batches; --prefix-cache-test adds time to "
        "first token with a shared prefix, caching on vs off.",
        add_throughput_arguments,
        _throughput,
    ),
    "fairness": Bench(
        "latency and tenant-fair scheduling through the HTTP server, policy vs policy",
        "Start loraplex serve once per policy and repeat (alternating) and measure, over "
        "HTTP with streaming clients: a flood from tenant A against B's occasional "
        "requests (B's p99 time to first token, total output tokens/s), the shares of "
        "two backlogged tenants with equal weights and with A's weight raised on the "
        "running server, and priority -1 requests jumping A's queue. Writes JSON and a "
        "PNG to --output-dir.",
        add_fairness_arguments,
        _fairness,
    ),
}

# Former ``loraplex bench`` commands, now acceptance experiments in the repository's benchmarks/.
MOVED: dict[str, str] = {
    name: f"python -m benchmarks.{module}"
    for name, module in {
        "adapter-churn": "adapter_churn",
        "masks": "masks",
        "structured-suite": "structured_suite",
        "structured": "structured",
        "contention": "contention",
        "speculative": "speculative",
        "gemm": "gemm",
        "replicas": "replicas",
    }.items()
}
