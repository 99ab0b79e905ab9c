"""``python -m benchmarks.speculative``: what prompt-lookup (``ngram``) speculative decoding buys, and
what it costs where it cannot help.

On one model (the embedded SmolLM2-135M-Instruct by default), in one process, two engines (one
with ``speculative_config`` ``ngram``, one without), greedy, in paired runs that alternate which
engine goes first, each figure the median over ``--repeats`` pairs:

* **copy** (target: at least 1.5x): batch 1, prompts that ask to repeat or lightly edit a
  passage of ``--copy-min-words`` to ``--copy-max-words`` words, ``--copy-tokens`` output tokens
  each (EOS ignored, so both engines emit the same count); one request at a time. Reports
  tokens/s of each engine, their ratio, the acceptance rate and tokens per verifying step.
* **throughput** (target: at least 0.9x): the workload of ``loraplex bench throughput`` (64
  requests of 20-60 words, 16-128 output tokens, ``workload.make_workload``), all submitted at
  once. With the default ``disable_by_batch_size`` speculation stays off while the batch is
  large and comes on as it drains; the figure says what that policy costs or gains.

Both engines must produce the same tokens (greedy speculation is exact): the bench checks it and
records ``outputs_equal``. Prefix caches are reset before every run. Writes
``speculative-<time>.json`` to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.argtypes import positive_int
from loraplex.bench.common import add_workload_arguments
from loraplex.bench.workload import encode, make_workload, random_text

Log = Callable[[str], None]

# The copy-heavy asks: repeat, or edit lightly (most of the output is still the passage).
COPY_ASKS = (
    "Repeat the following passage exactly, word for word:\n\n{passage}",
    "Copy the passage below, fixing any spelling or punctuation mistakes you find:\n\n{passage}",
    "Rewrite the passage below, changing as little as possible but replacing 'the' with "
    "'that' where it reads well:\n\n{passage}",
    "Here is a passage:\n\n{passage}\n\nWrite it out again in full, then add one more sentence "
    "at the end.",
)
COPY_TARGET = 1.5
THROUGHPUT_TARGET = 0.9


@dataclass(frozen=True)
class SpeculativeBenchOptions:
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None  # None: the engine's default for the device
    repeats: int = 3
    copy_prompts: int = 4
    copy_min_words: int = 150
    copy_max_words: int = 300
    copy_tokens: int = 192
    num_requests: int = 64
    min_output: int = 16
    max_output: int = 128
    min_prompt_words: int = 20
    max_prompt_words: int = 60
    max_num_seqs: int = 64
    max_model_len: int = 1024
    seed: int = 0
    skip_copy: bool = False
    skip_throughput: bool = False
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    output_dir: str = "bench-results"

    def __post_init__(self) -> None:
        if not 1 <= self.copy_min_words <= self.copy_max_words:
            raise ValueError("--copy-min-words must be at least 1 and at most --copy-max-words")
        if self.skip_copy and self.skip_throughput:
            raise ValueError("--skip-copy and --skip-throughput together leave nothing to run")

    def speculative_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "method": "ngram",
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_max": self.prompt_lookup_max,
            "prompt_lookup_min": self.prompt_lookup_min,
        }
        if self.disable_by_batch_size is not None:
            config["disable_by_batch_size"] = self.disable_by_batch_size
        return config


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    s = p.add_argument_group("speculative decoding (ngram)")
    s.add_argument("--num-speculative-tokens", type=positive_int, default=4)
    s.add_argument("--prompt-lookup-max", type=positive_int, default=4)
    s.add_argument("--prompt-lookup-min", type=positive_int, default=2)
    s.add_argument(
        "--disable-by-batch-size",
        type=positive_int,
        default=None,
        help="no speculation in a step with more decoding requests (default: the device's)",
    )
    c = p.add_argument_group("copy-heavy workload (batch 1)")
    c.add_argument("--copy-prompts", type=positive_int, default=4, help="requests per run")
    c.add_argument("--copy-min-words", type=positive_int, default=150)
    c.add_argument("--copy-max-words", type=positive_int, default=300)
    c.add_argument("--copy-tokens", type=positive_int, default=192, help="output tokens each")
    c.add_argument("--skip-copy", action="store_true")
    t = p.add_argument_group("throughput workload (loraplex bench throughput's)")
    add_workload_arguments(t)
    t.add_argument("--max-num-seqs", type=positive_int, default=64)
    t.add_argument("--skip-throughput", action="store_true")
    x = p.add_argument_group("runs and output")
    x.add_argument("--repeats", type=positive_int, default=3, help="paired runs per workload")
    x.add_argument("--max-model-len", type=positive_int, default=1024)
    x.add_argument("--seed", type=int, default=0)
    x.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads (default: torch's; 1 gives steadier figures on a busy machine)",
    )
    x.add_argument("--output-dir", default="bench-results")


def options_from(args: argparse.Namespace) -> SpeculativeBenchOptions:
    return SpeculativeBenchOptions(
        model=args.model,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min,
        disable_by_batch_size=args.disable_by_batch_size,
        repeats=args.repeats,
        copy_prompts=args.copy_prompts,
        copy_min_words=args.copy_min_words,
        copy_max_words=args.copy_max_words,
        copy_tokens=args.copy_tokens,
        num_requests=args.num_requests,
        min_output=args.min_output,
        max_output=args.max_output,
        min_prompt_words=args.min_prompt_words,
        max_prompt_words=args.max_prompt_words,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        seed=args.seed,
        skip_copy=args.skip_copy,
        skip_throughput=args.skip_throughput,
        threads=args.threads,
        output_dir=args.output_dir,
    )


# ---- workloads ---------------------------------------------------------------------------------


def copy_prompts(tokenizer: Any, opts: SpeculativeBenchOptions) -> list[list[int]]:
    """Token ids of the copy-heavy asks (in the chat template where the model has one)."""
    rng = random.Random(opts.seed)
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = []
    for i in range(opts.copy_prompts):
        passage = random_text(rng, rng.randint(opts.copy_min_words, opts.copy_max_words))
        ask = COPY_ASKS[i % len(COPY_ASKS)].format(passage=passage)
        prompts.append(encode(tokenizer, ask, chat=chat))
    return prompts


def throughput_prompts(
    tokenizer: Any, opts: SpeculativeBenchOptions
) -> tuple[list[list[int]], list[int]]:
    workload = make_workload(
        opts.num_requests,
        opts.min_output,
        opts.max_output,
        min_words=opts.min_prompt_words,
        max_words=opts.max_prompt_words,
        seed=opts.seed,
    )
    return [encode(tokenizer, p) for p in workload.prompts], workload.output_lens


# ---- runs --------------------------------------------------------------------------------------


def _spec_counters(llm: Any) -> dict[str, int]:
    spec = llm.engine_stats().speculative
    if spec is None:
        return {}
    return {
        "verifications": spec.num_verifications,
        "draft_tokens": spec.num_draft_tokens,
        "accepted_tokens": spec.num_accepted_tokens,
        "emitted_tokens": spec.num_emitted_tokens,
        "steps_off": spec.num_steps_off,
    }


def _timed_run(llm: Any, batches: list[tuple[list[list[int]], list[Any]]]) -> dict[str, Any]:
    """Run each batch to the end, one after another; output tokens/s over all of them."""
    llm.reset_prefix_cache()
    before = _spec_counters(llm)
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for prompts, params in batches:
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens.extend(list(o.outputs[0].token_ids) for o in outs)
    seconds = time.perf_counter() - start
    after = _spec_counters(llm)
    n = sum(map(len, tokens))
    run: dict[str, Any] = {"seconds": round(seconds, 4), "output_tokens": n,
                           "tokens_per_s": n / seconds}  # fmt: skip
    if after:
        delta = {k: after[k] - before.get(k, 0) for k in after}
        drafted = delta["draft_tokens"]
        run["spec"] = delta
        run["acceptance_rate"] = delta["accepted_tokens"] / drafted if drafted else 0.0
        verified = delta["verifications"]
        run["tokens_per_verification"] = delta["emitted_tokens"] / verified if verified else 0.0
    run["_tokens"] = tokens
    return run


def paired(
    plain: Any,
    spec: Any,
    batches: list[tuple[list[list[int]], list[Any]]],
    repeats: int,
    name: str,
    say: Log,
) -> dict[str, Any]:
    """Alternating paired runs; medians of each engine's tokens/s and of the per-pair ratio."""
    runs: list[dict[str, Any]] = []
    equal = True
    for r in range(repeats):
        order = [("off", plain), ("ngram", spec)]
        if r % 2:
            order.reverse()
        pair: dict[str, Any] = {label: _timed_run(llm, batches) for label, llm in order}
        equal = equal and pair["off"]["_tokens"] == pair["ngram"]["_tokens"]
        for run in pair.values():
            del run["_tokens"]
        pair["ratio"] = pair["ngram"]["tokens_per_s"] / pair["off"]["tokens_per_s"]
        pair["first"] = order[0][0]
        runs.append(pair)
        say(
            f"{name} pair {r + 1}/{repeats}: off {pair['off']['tokens_per_s']:.1f} tok/s, ngram "
            f"{pair['ngram']['tokens_per_s']:.1f} tok/s, ratio {pair['ratio']:.3f}, acceptance "
            f"{pair['ngram'].get('acceptance_rate', 0.0):.2f}"
        )

    def med(values: list[float]) -> float:
        return statistics.median(values)

    return {
        "tokens_per_s_off": med([p["off"]["tokens_per_s"] for p in runs]),
        "tokens_per_s_ngram": med([p["ngram"]["tokens_per_s"] for p in runs]),
        "ratio": med([p["ratio"] for p in runs]),
        "acceptance_rate": med([p["ngram"].get("acceptance_rate", 0.0) for p in runs]),
        "tokens_per_verification": med(
            [p["ngram"].get("tokens_per_verification", 0.0) for p in runs]
        ),
        "outputs_equal": equal,
        "runs": runs,
    }


def _say(message: str) -> None:
    print(message, flush=True)


def run_speculative(opts: SpeculativeBenchOptions, say: Log = _say) -> dict[str, Any]:
    import torch

    from loraplex.bench.common import machine
    from loraplex.llm import LLM
    from loraplex.sampling_params import SamplingParams

    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    knobs: dict[str, Any] = dict(max_num_seqs=opts.max_num_seqs, max_model_len=opts.max_model_len)
    plain = LLM(opts.model, **knobs)
    spec = LLM(opts.model, **knobs, speculative_config=opts.speculative_config())
    tokenizer = plain.get_tokenizer()
    spec_stats = spec.engine_stats().speculative
    assert spec_stats is not None  # built with a speculative config
    result: dict[str, Any] = {
        "benchmark": "speculative",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": opts.model or "embedded:SmolLM2-135M-Instruct",
        "options": {k: v for k, v in vars(opts).items()},
        "speculative_config": opts.speculative_config(),
        "disable_by_batch_size": spec_stats.disable_by_batch_size,
        "machine": machine(),
    }
    if not opts.skip_copy:
        prompts = copy_prompts(tokenizer, opts)
        params = SamplingParams(max_tokens=opts.copy_tokens, temperature=0.0, ignore_eos=True)
        batches = [([p], [params]) for p in prompts]  # batch 1: one request at a time
        copy = paired(plain, spec, batches, opts.repeats, "copy", say)
        copy["prompt_tokens"] = [len(p) for p in prompts]
        copy["target_ratio"] = COPY_TARGET
        copy["meets_target"] = copy["ratio"] >= COPY_TARGET
        result["copy"] = copy
    if not opts.skip_throughput:
        prompts, lens = throughput_prompts(tokenizer, opts)
        params_list = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
        tp = paired(plain, spec, [(prompts, params_list)], opts.repeats, "throughput", say)
        tp["num_requests"] = len(prompts)
        tp["target_ratio"] = THROUGHPUT_TARGET
        tp["meets_target"] = tp["ratio"] >= THROUGHPUT_TARGET
        result["throughput"] = tp
    del plain, spec
    gc.collect()
    out_dir = Path(opts.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"speculative-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for key in ("copy", "throughput"):
        if key in result:
            v = result[key]
            say(
                f"{key}: off {v['tokens_per_s_off']:.1f} tok/s, ngram "
                f"{v['tokens_per_s_ngram']:.1f} tok/s, ratio {v['ratio']:.3f} (target "
                f">= {v['target_ratio']}), acceptance {v['acceptance_rate']:.2f}, "
                f"{v['tokens_per_verification']:.2f} tokens per verifying step, "
                f"outputs equal: {v['outputs_equal']}"
            )
    say(f"results: {path}")
    return result


DESCRIPTION = (
    "On the model (offline LLM, one process, two engines): tokens/s with ngram speculative "
    "decoding against none, in paired alternating runs (median), on a copy-heavy workload at "
    "batch 1 (prompts that repeat or lightly edit a passage) and on loraplex bench "
    "throughput's 64-request workload; with the acceptance rate. Writes JSON to --output-dir."
)


def _main_run(args: argparse.Namespace) -> int:
    run_speculative(options_from(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import run_main

    return run_main("speculative", DESCRIPTION, add_speculative_arguments, _main_run, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
