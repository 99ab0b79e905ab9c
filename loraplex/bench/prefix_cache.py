"""Time to first token with and without automatic prefix caching, same machine, same run.

Each repetition uses its own shared document of ``prefix_len`` tokens followed by two short unique
questions. Request 1 (document + question A) runs first and fills the cache; request 2
(document + question B) is then timed with ``max_tokens=1``, a proxy for time to first token.
Two ``LLM`` instances are compared: prefix caching on, and off. With caching on, the engine's
counters must show that only request 2's unshared tokens were computed.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Any

from loraplex.bench.systems import EngineArgs, build_llm, counters, greedy_params
from loraplex.bench.workload import encode, random_text, shared_prefix_ids


def run_prefix_cache_test(
    model_dir: str,
    tokenizer: Any,
    args: EngineArgs,
    *,
    prefix_len: int = 512,
    repeats: int = 5,
    seed: int = 0,
    log: Any = print,
) -> dict[str, Any]:
    rng = random.Random(seed)
    trials = []
    for r in range(repeats):
        prefix = shared_prefix_ids(tokenizer, prefix_len, seed=seed * 1000 + r)
        first = prefix + encode(tokenizer, f" Question A{r}: " + random_text(rng, 8))
        second = prefix + encode(tokenizer, f" Question B{r}: " + random_text(rng, 8))
        trials.append((first, second))

    results: dict[str, Any] = {"prefix_len": prefix_len, "repeats": repeats}
    for caching in (True, False):
        name = "caching_on" if caching else "caching_off"
        llm = build_llm(model_dir, args, enable_prefix_caching=caching)
        warm = shared_prefix_ids(tokenizer, 64, seed=seed + 7919)
        llm.generate([warm], greedy_params([2]), use_tqdm=False)
        runs = []
        for first, second in trials:
            llm.generate([first], greedy_params([1]), use_tqdm=False)
            before = counters(llm)
            start = time.perf_counter()
            llm.generate([second], greedy_params([1]), use_tqdm=False)
            seconds = time.perf_counter() - start
            after = counters(llm)
            runs.append(
                {
                    "ttft_s": round(seconds, 5),
                    "prompt_tokens": len(second),
                    "hit_tokens": after.get("prefix_cache_hits", 0)
                    - before.get("prefix_cache_hits", 0),
                    "computed_prompt_tokens": after.get("num_prompt_tokens_computed", 0)
                    - before.get("num_prompt_tokens_computed", 0),
                }
            )
        median = statistics.median(r["ttft_s"] for r in runs)
        results[name] = {"median_ttft_s": round(median, 5), "runs": runs}
        log(f"  prefix caching {'on ' if caching else 'off'}: median TTFT {median * 1e3:.1f} ms")
        del llm
        gc.collect()  # free this instance's KV cache before the next one allocates its own

    on, off = results["caching_on"], results["caching_off"]
    results["ttft_ratio_off_over_on"] = (
        round(off["median_ttft_s"] / on["median_ttft_s"], 3) if on["median_ttft_s"] > 0 else None
    )
    # Only the unshared tail should be computed: prompt minus the cached full blocks of the prefix.
    bs = args.config.cache.block_size
    cached_tokens = (prefix_len // bs) * bs
    results["expected_hit_tokens"] = cached_tokens
    results["only_unshared_computed"] = all(
        r["hit_tokens"] == cached_tokens
        and r["computed_prompt_tokens"] == r["prompt_tokens"] - cached_tokens
        for r in on["runs"]
    )
    return results


def add_prefix_cache_test(
    result: dict[str, Any],
    opts: Any,
    model_dir: str,
    tokenizer: Any,
    log: Any,
) -> None:
    """Run the prefix-caching experiment into ``result`` when ``opts.prefix_cache_test`` is on."""
    if not opts.prefix_cache_test:
        return
    log(f"prefix caching test: shared {opts.prefix_len}-token prefix ...")
    result["prefix_cache_test"] = run_prefix_cache_test(
        model_dir,
        tokenizer,
        opts.engine,
        prefix_len=opts.prefix_len,
        repeats=opts.prefix_repeats,
        seed=opts.seed,
        log=log,
    )
