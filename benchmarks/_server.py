"""A server a benchmark starts: a port for it, and one loop that waits until it is healthy."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Any

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(
    proc: subprocess.Popen[Any],
    base: str,
    log: Path | IO[str],
    *,
    timeout_s: float = 300.0,
    interval_s: float = 0.5,
) -> None:
    """Return once ``GET {base}/health`` answers 200. ``SystemExit`` with the tail of ``log``
    (the server's output: a file's path, or the open file it writes to) if the server exits
    first or is not healthy in ``timeout_s``; then it is killed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}):\n{_tail(log)}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    proc.kill()
    raise SystemExit(f"the server was not healthy in {timeout_s:g} s:\n{_tail(log)}")


def _tail(log: Path | IO[str], chars: int = 3000) -> str:
    if not isinstance(log, Path):  # an open file the server writes to (maybe nameless)
        log.flush()
        log.seek(0)
        text = log.read()
        log.seek(0, 2)
        return text[-chars:]
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return f"(no log at {log})"
