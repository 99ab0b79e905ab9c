"""How long another client's ``GET /version`` takes while `loraplex serve` handles a huge prompt.

Starts ``loraplex serve`` (the embedded SmolLM2-135M-Instruct unless a model is given, no
platform) on a free port, then polls ``/version`` every 20 ms while, in turn:

* nothing else runs (the baseline);
* the first request, which loads the tokenizer (once);
* a 7 MB prompt is sent to /v1/completions and to /v1/chat/completions (refused: it cannot fit
  the 8,192-token context);
* a large prompt that fits (128,000 characters of 64-character tokens: 2,000 tokens) is sent
  to /v1/completions with max_tokens 1 (tokenized in full, then prefilled by the engine, in its
  own process: most of that request's time on a CPU).

The body limit is raised (``LORAPLEX_MAX_REQUEST_BYTES``, default 16 MiB here) so that the 7 MB
prompt reaches the handler instead of getting a 413. Prints one JSON object: per case, the big
request's status and seconds, and the p50/max latency of /version in milliseconds.

    python -m benchmarks.event_loop_latency [MODEL] [--max-request-bytes N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import httpx

from benchmarks._server import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
HUGE = "hello world, this is a long prompt. " * 200_000  # 7.2 MB


def _start(
    model: str | None, port: int, max_request_bytes: int, log: IO[str]
) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "loraplex.cli", "serve", "--no-platform", "--port", str(port)]
    if model:
        args.insert(4, model)
    env = {**os.environ, "LORAPLEX_MAX_REQUEST_BYTES": str(max_request_bytes)}
    # The server logs every request: into a file, never a pipe nobody reads (a full pipe
    # would block the server).
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=log, text=True)
    wait_healthy(proc, f"http://127.0.0.1:{port}", log)
    return proc


def _poll_during(base: str, path: str | None, body: dict[str, Any] | None) -> dict[str, Any]:
    """/version latencies while ``body`` is posted to ``path`` (or for 2 s when path is None)."""
    out: dict[str, Any] = {}
    content = json.dumps(body).encode() if body is not None else b""

    def big() -> None:
        start = time.perf_counter()
        r = httpx.post(
            base + (path or ""),
            content=content,
            headers={"content-type": "application/json"},
            timeout=600,
        )
        out["status"] = r.status_code
        out["code"] = r.json().get("error", {}).get("code") if r.status_code >= 400 else None
        out["request_s"] = round(time.perf_counter() - start, 3)

    thread = threading.Thread(target=big if path else lambda: time.sleep(2.0))
    latencies: list[float] = []
    with httpx.Client(base_url=base, timeout=60) as client:
        client.get("/version")  # a warm connection
        thread.start()
        while thread.is_alive():
            start = time.perf_counter()
            with contextlib.suppress(httpx.TimeoutException):  # counted as its 60 s
                client.get("/version")
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
        thread.join()
    out["version_samples"] = len(latencies)
    out["version_p50_ms"] = round(statistics.median(latencies) * 1000, 1)
    out["version_max_ms"] = round(max(latencies) * 1000, 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="model directory (default: the embedded one)")
    parser.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024)
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = _start(args.model, port, args.max_request_bytes, log)
        try:
            model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
            # The first request loads the tokenizer (once, in a worker thread): measured apart.
            warm = {"model": model, "prompt": "hi", "max_tokens": 1}
            user = [{"role": "user", "content": HUGE}]
            cases = {
                "idle": (None, None),
                "first_request_loads_the_tokenizer": ("/v1/completions", warm),
                "completions_7mb_prompt": ("/v1/completions", {"model": model, "prompt": HUGE}),
                "chat_7mb_message": ("/v1/chat/completions", {"model": model, "messages": user}),
                "completions_large_valid_prompt": (
                    "/v1/completions",
                    {"model": model, "prompt": "#" * 128_000, "max_tokens": 1},
                ),
            }
            result: dict[str, Any] = {
                "model": model,
                "max_request_bytes": args.max_request_bytes,
                "prompt_bytes": len(HUGE.encode()),
                "cases": {name: _poll_during(base, *case) for name, case in cases.items()},
            }
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
