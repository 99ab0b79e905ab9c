"""The engine in bf16 (``dtype=auto`` on a CPU with AVX512-BF16/AMX) against fp32, in one process.

    python -m benchmarks.dtype_ab --pairs 5

Two engines on the embedded SmolLM2-135M-Instruct, ``dtype=auto`` resolved to bfloat16 and to
float32 (``LORAPLEX_CPU_AUTO_DTYPE``); ``loraplex bench throughput``'s
64-request workload (20-60 words, 16-128 tokens, greedy, EOS ignored), one untimed run each,
then alternating timed runs (the order flips every pair). Prints JSON: tokens/s per run, the
per-pair bf16/fp32 ratios and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from loraplex import LLM, SamplingParams
from loraplex.bench.workload import encode, make_workload
from loraplex.engine.default_model import embedded_model_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=5)
    args = p.parse_args()
    md = str(embedded_model_dir())
    llms = {}
    for name in ("bfloat16", "float32"):
        os.environ["LORAPLEX_CPU_AUTO_DTYPE"] = name  # read when the engine is built
        llms[name] = LLM(md, dtype="auto")
    wl = make_workload(64, 16, 128, seed=0)
    prompts = [encode(llms["float32"].llm_engine.tokenizer, t) for t in wl.prompts]
    params = [
        SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in wl.output_lens
    ]

    def run(llm: LLM) -> float:
        t = time.perf_counter()
        outs = llm.generate([list(x) for x in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    for llm in llms.values():
        run(llm)
    res: dict[str, list[float]] = {"bfloat16": [], "float32": []}
    for i in range(args.pairs):
        for name in ("bfloat16", "float32") if i % 2 == 0 else ("float32", "bfloat16"):
            res[name].append(round(run(llms[name]), 1))
    ratios = [round(b / f, 3) for b, f in zip(res["bfloat16"], res["float32"], strict=True)]
    print(json.dumps({"tokens_per_s": res, "bf16_over_fp32": ratios,
                      "median": statistics.median(ratios), "load_average": os.getloadavg()}))  # fmt: skip


if __name__ == "__main__":
    main()
