"""Load from outside: ``loraplex serve`` in a subprocess and streaming clients over HTTP.

``ServerProcess`` starts the server on a free local port with a fresh data directory and waits
for ``/health``; ``Platform`` creates tenants and keys through the admin API; ``stream`` sends
one streaming completion and records when it was sent, when each chunk arrived and how many
tokens it generated (the usage the server reports at the end).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

LATENCY_FAMILIES = (
    "loraplex_time_to_first_token_seconds",  # the API server's: arrival to first token
    "loraplex_request_queue_time_seconds",  # the engine's waiting queue
)
STARTUP_TIMEOUT_S = 300.0  # the first start also converts the embedded model and builds kernels


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerError(RuntimeError):
    """The server did not start, or answered an admin call with an error."""


class ServerProcess:
    """``loraplex serve ARGS`` on 127.0.0.1 with its own data directory, admin token and log."""

    def __init__(self, args: list[str], data_dir: Path, admin_token: str) -> None:
        self.port = free_port()
        self.args = args
        self.data_dir = data_dir
        self.admin_token = admin_token
        self.log_path = data_dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "loraplex.cli", "serve", *self.args]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--data-dir", str(self.data_dir)]
        env = {**os.environ, "LORAPLEX_ADMIN_TOKEN": self.admin_token, "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"the server exited at start:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"the server was not healthy in {STARTUP_TIMEOUT_S:g} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Platform:
    """The admin API calls a benchmark needs: tenants with a weight and a priority limit."""

    def __init__(self, http: httpx.AsyncClient, admin_token: str) -> None:
        self.http = http
        self.headers = {"Authorization": f"Bearer {admin_token}"}

    async def _call(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.request(method, path, headers=self.headers, json=body)
        if not r.is_success:
            raise ServerError(f"{method} {path}: {r.status_code} {r.text[:500]}")
        result: dict[str, Any] = r.json()
        return result

    async def tenant(self, name: str, *, weight: float = 1.0, max_priority: int = 0) -> str:
        """Create tenant ``name``; returns a new inference key for it."""
        body = {"name": name, "weight": weight, "max_priority": max_priority}
        await self._call("POST", "/admin/api/tenants", body)
        return await self.key(name)

    async def key(self, tenant: str, name: str = "bench") -> str:
        """A new inference key for the existing tenant ``tenant``."""
        key = await self._call("POST", f"/admin/api/tenants/{tenant}/keys", {"name": name})
        return str(key["key"])

    async def set_weight(self, name: str, weight: float) -> None:
        await self._call("PATCH", f"/admin/api/tenants/{name}", {"weight": weight})

    async def latency_sums(self) -> dict[tuple[str, str], tuple[float, float]]:
        """From ``/metrics``: (family, tenant id) -> (sum, count) of the server's time to first
        token and engine queue time histograms (subtract two readings for a window)."""
        from prometheus_client.parser import text_string_to_metric_families

        r = await self.http.get("/metrics", headers=self.headers)
        if not r.is_success:
            raise ServerError(f"GET /metrics: {r.status_code} {r.text[:200]}")
        out: dict[tuple[str, str], list[float]] = {}
        for family in text_string_to_metric_families(r.text):
            if family.name not in LATENCY_FAMILIES:
                continue
            for sample in family.samples:
                part = {"_sum": 0, "_count": 1}.get(sample.name.removeprefix(family.name))
                if part is not None:
                    key = (family.name, sample.labels.get("tenant", "-"))
                    out.setdefault(key, [0.0, 0.0])[part] += sample.value
        return {k: (v[0], v[1]) for k, v in out.items()}

    async def engine(self) -> dict[str, Any]:
        r = await self.http.get("/admin/api/engine", headers=self.headers)
        result: dict[str, Any] = r.json() if r.is_success else {"status": r.status_code}
        return result


@dataclass
class StreamRecord:
    """One streamed completion, timed on the client (``time.monotonic``)."""

    tenant: str
    sent: float
    priority: int = 0
    first: float | None = None  # the first chunk with text
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0  # completion tokens, from the final usage chunk
    status: int = 200
    error: str | None = None  # also set by an error event inside a 200 stream
    error_code: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    def tokens_between(self, start: float, end: float) -> float:
        """The tokens generated in ``[start, end)``: the usage spread over the chunks."""
        if not self.chunk_times or not self.tokens:
            return 0.0
        inside = sum(1 for t in self.chunk_times if start <= t < end)
        return self.tokens * inside / len(self.chunk_times)


async def stream(
    http: httpx.AsyncClient,
    key: str,
    tenant: str,
    prompt: str,
    max_tokens: int,
    *,
    model: str,
    priority: int = 0,
    extra: dict[str, Any] | None = None,
) -> StreamRecord:
    """One streaming ``/v1/completions`` request (EOS ignored, so it makes ``max_tokens``);
    ``extra`` adds fields to the body (a constraint, say)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if priority:
        body["priority"] = priority
    body |= extra or {}
    record = StreamRecord(tenant, time.monotonic(), priority)
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            record.status = r.status_code
            if r.status_code != 200:
                error = json.loads(await r.aread()).get("error", {})
                record.error, record.error_code = error.get("message"), error.get("code")
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):  # the server's error after the stream started
                    record.error = chunk["error"].get("message")
                    record.error_code = chunk["error"].get("code")
                if chunk.get("usage"):
                    record.tokens = int(chunk["usage"]["completion_tokens"])
                if any(c.get("text") for c in chunk.get("choices", ())):
                    now = time.monotonic()
                    record.first = record.first or now
                    record.chunk_times.append(now)
    except httpx.HTTPError as exc:
        record.status, record.error = 0, f"{type(exc).__name__}: {exc}"
    finally:
        record.end = time.monotonic()
    return record
