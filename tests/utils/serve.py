"""``loraplex serve`` in a subprocess on a free port: ``Serve(args, env).start()`` waits for
/health, ``stop(sig)`` signals it and returns its exit code."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """``loraplex serve`` in a subprocess; ``start()`` waits for /health."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.args = args
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[str] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Serve:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loraplex.cli", "serve", *self.args, "--port", str(self.port)],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(self.proc.stdout.read() if self.proc.stdout else "server exited")
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        pytest.fail("server did not become healthy in 120 s")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
