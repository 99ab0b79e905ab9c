"""loraplex's server against vLLM's, measured by vLLM's own client, in alternating pairs.

    python -m benchmarks.serve_vs_vllm --vllm-python /work/venv-vllm/bin/python --pairs 2
    python -m benchmarks.serve_vs_vllm ... --adapters 8          # 8 rank-8 adapters, round robin
    python -m benchmarks.serve_vs_vllm ... --loraplex-platform   # loraplex with tenants and keys
    python -m benchmarks.serve_vs_vllm ... --against no-platform # platform vs --no-platform

Each run starts one server on the embedded SmolLM2-135M-Instruct (``loraplex serve
--no-platform`` at its default dtype, or the full platform with one tenant key; ``vllm serve``
at ``--vllm-dtype``, ``VLLM_CPU_KVCACHE_SPACE=2``), waits for it, sends one short warm-up
round, then runs ``vllm bench serve --backend vllm --dataset-name random --random-input-len 256
--random-output-len 128 --num-prompts 64 --max-concurrency 32 --ignore-eos`` (issue 32's
command) against it and stops it. The systems alternate, the order flipping every pair. Prints
and writes JSON: output tokens/s, TTFT median/p99 and TPOT median per run, and the medians of
the per-pair loraplex/vLLM ratios. ``--against no-platform`` puts the full platform against
``--no-platform`` instead (both loraplex; the ratio is platform over no-platform). vLLM is never
a dependency of loraplex: ``--vllm-python`` is the interpreter of its own virtual environment
(its client measures every run).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks._server import free_port, wait_healthy
from benchmarks.vllm_dtype import CHOICES, resolve_vllm_dtype

REPO = Path(__file__).resolve().parents[1]
NAME = "SmolLM2-135M-Instruct"
BENCH = ["--backend", "vllm", "--dataset-name", "random", "--random-input-len", "256",
         "--random-output-len", "128", "--num-prompts", "64", "--max-concurrency", "32",
         "--ignore-eos"]  # fmt: skip


def platform_key(url: str, admin: str) -> str:
    h = {"Authorization": f"Bearer {admin}"}
    r = httpx.post(f"{url}/admin/api/tenants", json={"name": "bench"}, headers=h, timeout=30)
    r.raise_for_status()
    r = httpx.post(f"{url}/admin/api/tenants/bench/keys", json={"name": "k"}, headers=h, timeout=30)
    r.raise_for_status()
    return str(r.json()["key"])


def run_one(system: str, args: argparse.Namespace, model_dir: str, loras: dict[str, str],
            tmp: Path, tag: str) -> dict[str, object]:  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / f"{tag}.log"
    env = dict(os.environ)
    key = "none"
    platform = False  # loraplex with tenants and keys (vLLM: never)
    if system == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
        argv = [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", model_dir,
                "--served-model-name", NAME, "--dtype", args.vllm_dtype, "--port", str(port),
                "--max-model-len", "2048"]  # fmt: skip
        if loras:
            argv += ["--enable-lora", "--max-loras", str(len(loras)), "--max-lora-rank", "8",
                     "--lora-modules", *(f"{n}={p}" for n, p in loras.items())]  # fmt: skip
    else:
        argv = [sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port),
                "--served-model-name", NAME, "--log-level", "warning",
                "--data-dir", str(tmp / f"{tag}-data")]  # fmt: skip
        platform = system == "loraplex-platform" or (
            system == "loraplex" and args.loraplex_platform
        )
        if not platform:
            argv.append("--no-platform")
        if loras:
            # as many adapters in one step as vLLM is given (--max-loras), on both sides
            argv += ["--max-loras", str(len(loras)),
                     "--lora-modules", *(f"{n}={p}" for n, p in loras.items())]  # fmt: skip
        admin = secrets.token_urlsafe(24)
        env["LORAPLEX_ADMIN_TOKEN"] = admin
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, url, log, timeout_s=600, interval_s=1.0)
        if platform:
            key = platform_key(url, admin)
        client = [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
                  "--base-url", url, "--model", NAME, "--tokenizer", model_dir, *BENCH]  # fmt: skip
        if loras:
            client += ["--lora-modules", *loras, "--lora-assignment", "round-robin"]
        benv = {**os.environ, "OPENAI_API_KEY": key}
        warm = [*client, "--num-prompts", "8", "--max-concurrency", "8"]  # the last flag wins
        subprocess.run(warm, env=benv, capture_output=True, check=False)  # first-request costs
        bench = [*client, "--save-result", "--result-dir", str(tmp),
                 "--result-filename", f"{tag}.json"]  # fmt: skip
        done = subprocess.run(bench, env=benv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{done.stderr[-3000:]}")
        got = json.loads((tmp / f"{tag}.json").read_text())
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {
        "system": system,
        "output_tokens_per_s": round(got["output_throughput"], 2),
        "ttft_median_ms": round(got["median_ttft_ms"], 1),
        "ttft_p99_ms": round(got["p99_ttft_ms"], 1),
        "tpot_median_ms": round(got["median_tpot_ms"], 2),
        "completed": got["completed"],
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--vllm-dtype", choices=CHOICES, default="auto",
                   help="auto (default): bf16 where the CPU has AMX-BF16 or AVX512-BF16, else fp32")  # fmt: skip
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--adapters", type=int, default=0, help="rank-8 random adapters, round robin")
    p.add_argument("--loraplex-platform", action="store_true", help="loraplex with tenants/keys")
    p.add_argument("--against", choices=["vllm", "no-platform"], default="vllm",
                   help="no-platform: the full platform against loraplex serve --no-platform")  # fmt: skip
    p.add_argument("--out", default="bench-results")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    args.vllm_dtype, vllm_dtype_reason = resolve_vllm_dtype(args.vllm_dtype)
    from loraplex.bench.adapters import make_random_adapters
    from loraplex.engine.default_model import embedded_model_dir

    model_dir = str(embedded_model_dir())
    runs: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="serve-vs-vllm-") as tmp_name:
        tmp = Path(tmp_name)
        loras = (
            make_random_adapters(model_dir, tmp / "adapters", args.adapters, rank=8)
            if args.adapters else {}
        )  # fmt: skip
        first, second = ("loraplex-platform", "loraplex") if args.against == "no-platform" else (
            "loraplex", "vllm")  # fmt: skip
        for i in range(args.pairs):
            for system in (first, second) if i % 2 == 0 else (second, first):
                run = run_one(system, args, model_dir, loras, tmp, f"{system}-{i}")
                runs.append({"pair": i, **run})
                print(json.dumps(runs[-1]), flush=True)

    def ratio(key: str) -> float:
        per = []
        for i in range(args.pairs):
            mine = {str(r["system"]): r for r in runs if r["pair"] == i}
            per.append(float(mine[first][key]) / float(mine[second][key]))  # type: ignore[arg-type]
        return round(statistics.median(per), 3)

    result = {
        "command": " ".join(["python", "-m benchmarks.serve_vs_vllm", *sys.argv[1:]]),
        "bench": ["vllm", "bench", "serve", *BENCH],
        "vllm_dtype": args.vllm_dtype,
        "vllm_dtype_reason": vllm_dtype_reason,
        "runs": runs,
        f"median_throughput_{first}_over_{second}": ratio("output_tokens_per_s"),
        f"median_ttft_p99_{first}_over_{second}": ratio("ttft_p99_ms"),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out, f"serve-vs-vllm-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
