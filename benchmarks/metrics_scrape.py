"""Does an endpoint picker's scraping slow the workload? (issue 33: 50 scrapes/s for 10 s must not
slow a running workload by more than 5 %.)

Starts ``loraplex serve`` (the embedded SmolLM2-135M-Instruct unless a model is given; the
platform on, with ``--metrics-port``) and keeps ``--concurrency`` completion requests running
(``max_tokens`` tokens each, ``ignore_eos``, streamed) for the whole run. The run is cut into
windows of ``--window`` seconds, alternating (``--pairs`` times) one without scrapes and one
with a scraper (its own process) that GETs the metrics port ``--rate`` times a second without
credentials; which of the two comes first alternates from pair to pair. Per window: tokens
streamed per second, and the API server process's CPU seconds. Per pair: scraped over quiet
throughput. Prints (and with ``--output`` writes) one JSON object: each window, each pair's
ratio, their median and the slowdown ``1 - median``; the scrapes' status codes and latency
p50/p99; and their CPU cost in the API process (median scraped minus median quiet window, per
scrape and as a fraction of one core), which a noisy machine swings far less than throughput.
Linux only (``/proc``).

The snapshot the metrics port serves is taken every 0.5 s in both windows (it runs whenever
``--metrics-port`` is on): what is measured is the cost of the scrapes themselves.

    python -m benchmarks.metrics_scrape [MODEL] [--pairs 3] [--window 10] [--rate 50]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
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
ADMIN = "lpx-admin-scrape-bench-0123456789"


def _start(model: str | None, port: int, metrics_port: int, data: str, log: IO[str]) -> Any:
    args = [sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port),
            "--metrics-port", str(metrics_port), "--data-dir", data]  # fmt: skip
    if model:
        args.insert(4, model)
    env = {**os.environ, "LORAPLEX_ADMIN_TOKEN": ADMIN}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=log, text=True)
    wait_healthy(proc, f"http://127.0.0.1:{port}", log)
    return proc


class Workload:
    """``concurrency`` threads, each streaming one completion after another; ``tokens`` holds
    the time.monotonic() of every streamed chunk that carried text (one token each)."""

    def __init__(self, base: str, model: str, concurrency: int, max_tokens: int) -> None:
        self.base, self.model, self.max_tokens = base, model, max_tokens
        self.tokens: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(concurrency)]

    def _loop(self, i: int) -> None:
        headers = {"Authorization": f"Bearer {ADMIN}"}
        with httpx.Client(timeout=300, headers=headers) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {"model": self.model, "prompt": f"Story {i}.{n}: once upon a time",
                        "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0,
                        "stream": True}  # fmt: skip
                with client.stream("POST", f"{self.base}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        self.errors += 1
                        continue
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                            self.tokens.append(time.monotonic())

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def tokens_per_s(self, start: float, end: float) -> float:
        return sum(1 for t in self.tokens if start <= t < end) / (end - start)


class _Scrape:
    """A keep-alive HTTP/1.1 GET loop on one socket, as lean as a client can be: the endpoint
    picker is a Go program on another node, so the CPU the bench's own scraper takes from this
    machine's cores is an artefact to keep small, not part of what is measured."""

    def __init__(self, url: str) -> None:
        rest = url.split("://", 1)[1]
        hostport, _, path = rest.partition("/")
        host, _, port = hostport.rpartition(":")
        self.addr = (host, int(port))
        self.request = f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\n\r\n".encode()
        self.sock: socket.socket | None = None
        self.buf = b""

    def get(self) -> int:
        """One scrape; its status code (0: the connection failed; the next call reconnects)."""
        try:
            if self.sock is None:
                self.sock = socket.create_connection(self.addr, timeout=5)
                self.buf = b""
            self.sock.sendall(self.request)
            while b"\r\n\r\n" not in self.buf:
                self._read()
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))  # fmt: skip
            while len(self.buf) < length:
                self._read()
            self.buf = self.buf[length:]
            return status
        except (OSError, ValueError, StopIteration):
            if self.sock is not None:
                self.sock.close()
            self.sock = None
            return 0

    def _read(self) -> None:
        assert self.sock is not None
        chunk = self.sock.recv(65536)
        if not chunk:
            raise OSError("closed")
        self.buf += chunk


def _scraper(url: str, rate: float, window: Any, out: Any) -> None:
    """For each ``seconds`` taken from ``window`` (None: exit), GET ``url`` ``rate`` times a
    second for that long and put (status counts, latencies in ms) on ``out``. Its own process,
    started once: the scraper is another pod, not a thread competing with the workload's
    client for this process's GIL, and its start-up falls outside every window."""
    scrape = _Scrape(url)
    while (seconds := window.get()) is not None:
        codes: dict[int, int] = {}
        ms: list[float] = []
        next_at = time.monotonic()
        until = next_at + seconds
        while next_at < until:
            time.sleep(max(next_at - time.monotonic(), 0.0))
            t0 = time.perf_counter()
            code = scrape.get()
            ms.append((time.perf_counter() - t0) * 1000)
            codes[code] = codes.get(code, 0) + 1
            next_at += 1.0 / rate
        out.put((codes, ms))


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=50.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()

    port, metrics_port = free_port(), free_port()
    base, url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    with tempfile.TemporaryDirectory() as data, open(Path(data) / "serve.log", "w") as log:
        proc = _start(args.model, port, metrics_port, data, log)
        try:
            headers = {"Authorization": f"Bearer {ADMIN}"}
            model = httpx.get(f"{base}/v1/models", headers=headers).json()["data"][0]["id"]
            ctx = multiprocessing.get_context("spawn")
            window, out = ctx.Queue(), ctx.Queue()
            scraper = ctx.Process(target=_scraper, args=(url, args.rate, window, out))
            scraper.start()
            work = Workload(base, model, args.concurrency, args.max_tokens)
            work.start()
            time.sleep(args.warmup)
            windows: list[dict[str, Any]] = []
            codes: dict[int, int] = {}
            latencies: list[float] = []
            for pair in range(args.pairs):
                order = ("quiet", "scraped") if pair % 2 == 0 else ("scraped", "quiet")
                for kind in order:
                    start = time.monotonic()
                    end = start + args.window
                    cpu_start = _cpu_s(proc.pid)
                    if kind == "scraped":
                        window.put(args.window)
                        got_codes, got_ms = out.get(timeout=args.window + 60)
                        latencies += got_ms
                        for code, n in got_codes.items():
                            codes[code] = codes.get(code, 0) + n
                    time.sleep(max(end - time.monotonic(), 0.0))
                    windows.append({"pair": pair, "kind": kind,
                                    "tokens_per_s": round(work.tokens_per_s(start, end), 2),
                                    "api_process_cpu_s": round(_cpu_s(proc.pid) - cpu_start, 3)})  # fmt: skip
            work.stop()
            window.put(None)
            scraper.join()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    ratios = []
    for pair in range(args.pairs):
        rate = {w["kind"]: w["tokens_per_s"] for w in windows if w["pair"] == pair}
        ratios.append(round(rate["scraped"] / rate["quiet"], 4) if rate["quiet"] else None)
    valid = [r for r in ratios if r is not None]
    median = statistics.median(valid) if valid else None
    latencies.sort()
    cpu = {
        k: [w["api_process_cpu_s"] for w in windows if w["kind"] == k] for k in ("quiet", "scraped")
    }
    extra_cpu_s = statistics.median(cpu["scraped"]) - statistics.median(cpu["quiet"])
    result = {
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "window_s": args.window, "scrape_rate_per_s": args.rate,
        "windows": windows, "pair_ratios_scraped_over_quiet": ratios,
        "median_ratio": median,
        "slowdown": None if median is None else round(1 - median, 4),
        "met_5_percent": None if median is None else median >= 0.95,
        "scrapes": {"status_codes": codes, "count": len(latencies),
                    "latency_ms_p50": round(latencies[len(latencies) // 2], 2) if latencies else None,
                    "latency_ms_p99": round(latencies[int(len(latencies) * 0.99)], 2) if latencies else None},
        # the scrapes' own cost where it is paid: the API server process's CPU
        "api_cpu_ms_per_scrape": round(1000 * extra_cpu_s / (args.rate * args.window), 3),
        "api_cpu_core_fraction_for_scrapes": round(extra_cpu_s / args.window, 4),
        "workload_errors": work.errors,
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
