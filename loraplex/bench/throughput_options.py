"""``loraplex bench throughput``'s flags and the ``ThroughputOptions`` they become (light imports:
the CLI's parser imports this module)."""

from __future__ import annotations

import argparse

from loraplex.argtypes import positive_int
from loraplex.bench.adapter_options import adapter_options_from, add_adapter_arguments
from loraplex.bench.common import ThroughputOptions, add_workload_arguments
from loraplex.bench.systems import BENCH_KNOBS, EngineArgs
from loraplex.engine_args import add_engine_arguments

# The flags that map one to one onto ``ThroughputOptions`` fields of the same name.
_PLAIN = (
    *("model", "num_requests", "min_output", "max_output", "min_prompt_words", "max_prompt_words"),
    *("chat", "seed", "repeats", "hf_batch_size", "hf_max_requests", "skip_hf", "profile"),
    *("profile_requests", "prefix_cache_test", "prefix_len", "prefix_repeats", "output_dir"),
)


def add_throughput_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face directory or org/name hub id "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    w = p.add_argument_group("workload")
    add_workload_arguments(w)
    w.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--repeats", type=positive_int, default=3, help="alternating runs per system")
    add_adapter_arguments(
        p.add_argument_group(
            "multi-adapter mode",
            "--num-adapters N > 0 spreads the workload over N random LoRA adapters and compares "
            "loraplex with adapters, loraplex without, and two PEFT baselines; a list of N (or "
            "--systems without PEFT) sweeps N with loraplex only and reports the adapter pool",
        )
    )
    h = p.add_argument_group("Hugging Face / PEFT baselines")
    h.add_argument(
        "--hf-batch-size", type=positive_int, default=8, help="static batch size (per adapter)"
    )
    h.add_argument(
        "--hf-max-requests",
        type=positive_int,
        default=None,
        help="run the baselines on about N requests only (with adapters: whole batches) "
        "and take their rate",
    )
    h.add_argument(
        "--skip-hf", action="store_true", help="run loraplex only (with adapters: the sweep)"
    )
    add_engine_arguments(p.add_argument_group("loraplex engine"), names=BENCH_KNOBS)
    x = p.add_argument_group("experiments and output")
    x.add_argument(
        "--profile",
        action="store_true",
        help="also profile one loraplex run (torch.profiler, top ops by self CPU time)",
    )
    x.add_argument("--profile-requests", type=positive_int, default=16)
    x.add_argument(
        "--prefix-cache-test",
        action="store_true",
        help="also measure time to first token with a shared prefix, caching on vs off",
    )
    x.add_argument("--prefix-len", type=positive_int, default=512)
    x.add_argument("--prefix-repeats", type=positive_int, default=5)
    x.add_argument("--output-dir", default="bench-results")


def options_from(args: argparse.Namespace) -> ThroughputOptions:
    engine = EngineArgs({k: v for k in BENCH_KNOBS if (v := getattr(args, k)) is not None})
    plain = {name: getattr(args, name) for name in _PLAIN}
    return ThroughputOptions(**plain, engine=engine, **adapter_options_from(args))
