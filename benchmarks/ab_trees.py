"""Throughput of two source trees on one workload, in paired alternating runs.

    python -m benchmarks.ab_trees --old 7d428dc --adapters 32 --pairs 8

Exports ``--old`` (a git revision) to a temporary directory and starts two worker processes:
one imports loraplex from that export, the other from this checkout. Each builds its engine
once (the embedded model, ``--adapters`` random rank-8 adapters round robin over the
requests of ``loraplex bench throughput``'s 64-request workload, all resident, fp32 unless
``LORAPLEX_CPU_AUTO_DTYPE`` says otherwise) and runs the workload once untimed. Then the
workers take turns, the order flipping every pair; one run at a time, the other waits. Prints
and writes JSON: each run's output tokens/s, each pair's new/old ratio and the median ratio.
Used for issue 30's "no throughput lost at 32 adapters" and issue 32's "no regression of the
fp32 path" (``--adapters 0``, greedy and ``--temperature 1``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, os, sys, time
from pathlib import Path
from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.bench.workload import encode, make_workload
from loraplex.engine.default_model import embedded_model_dir

root, n, temperature = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
names = sorted(p.name for p in root.iterdir() if p.is_dir())[:n] if n else []
lora_args = dict(max_loras=n, max_cpu_loras=n, max_lora_rank=64) if n else {}
llm = LLM(str(embedded_model_dir()), max_num_seqs=64, max_num_batched_tokens=1024, **lora_args)
wl = make_workload(64, 16, 128, seed=0)
tok = llm.llm_engine.tokenizer
prompts = [encode(tok, p) for p in wl.prompts]
loras = [LoRARequest(names[i % n], str(root / names[i % n])) for i in range(len(prompts))] if n else None
params = [SamplingParams(max_tokens=k, temperature=temperature, ignore_eos=True)
          for k in wl.output_lens]

def run():
    t = time.perf_counter()
    outs = llm.generate([list(p) for p in prompts], params, lora_request=loras, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens, time.perf_counter() - t

run()
import loraplex
print("ready", loraplex.__file__, file=sys.stderr, flush=True)
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "run":
        break
    tokens, seconds = run()
    print(json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)
"""


def export(rev: str, into: Path) -> Path:
    data = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def start(tree: Path, adapters: Path, n: int, temperature: float) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.setdefault("LORAPLEX_CPU_AUTO_DTYPE", "float32")
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(adapters), str(n), str(temperature)],
        cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise RuntimeError(f"the worker in {tree} exited before it was ready")


def timed(proc: subprocess.Popen[str]) -> float:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("run\n")
    proc.stdin.flush()
    got = json.loads(proc.stdout.readline())
    return float(got["tokens"]) / float(got["seconds"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="git revision of the baseline tree")
    p.add_argument("--adapters", type=int, default=32, help="0: the base model alone")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--out", default="bench-results")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    from loraplex.bench.adapters import make_random_adapters
    from loraplex.engine.default_model import embedded_model_dir

    with tempfile.TemporaryDirectory(prefix="ab-trees-") as tmp:
        adapters = Path(tmp, "adapters")
        adapters.mkdir()
        if args.adapters:
            make_random_adapters(str(embedded_model_dir()), adapters, args.adapters, rank=8)
        old_tree = export(args.old, Path(tmp, "old"))
        workers = {"old": start(old_tree, adapters, args.adapters, args.temperature),
                   "new": start(REPO, adapters, args.adapters, args.temperature)}  # fmt: skip
        runs: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(args.pairs):
            for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                runs[name].append(round(timed(workers[name]), 2))
            print(f"pair {i + 1}: old {runs['old'][-1]} new {runs['new'][-1]} tok/s", flush=True)
        for proc in workers.values():
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait()
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    ratios = [round(n / o, 4) for o, n in zip(runs["old"], runs["new"], strict=True)]
    result = {
        "command": " ".join(["python", "-m benchmarks.ab_trees", *sys.argv[1:]]),
        "old": args.old,
        "new": head,
        "adapters": args.adapters,
        "temperature": args.temperature,
        "tokens_per_s": runs,
        "new_over_old": ratios,
        "median_new_over_old": statistics.median(ratios),
        "load_average": os.getloadavg(),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out, f"ab-trees-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
