"""The processes of ``python -m benchmarks.contention``: the engine children (each a system at one
OpenMP setting, talking ``worker``'s line protocol) and the competing busy processes.

Every process started here is ended here: a child by ``exit`` then kill after a grace period,
busy processes by kill when their run ends (also on an error or Ctrl-C).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from benchmarks.contention.worker import MARK, tree_pids

# A busy process: asks the kernel to kill it when its parent exits (so that no spinner outlives
# a killed benchmark), says it is running (one byte), then spins one core until killed.
BUSY_CODE = """\
import ctypes, os, sys
try:
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG = 1, SIGKILL = 9 (Linux)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)  # the parent is already gone
sys.stdout.write(".")
sys.stdout.flush()
while True:
    pass
"""
# OpenMP wait settings a child's environment never inherits: each child gets its own.
OMP_WAIT_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


class ChildError(RuntimeError):
    """A child failed, exited or did not answer in time."""


def loraplex_env(spin: str, base: Mapping[str, str], spin_env: str) -> dict[str, str]:
    """The loraplex child's environment for spin setting ``spin`` (``engine``, ``passive``,
    ``default`` or a whole number). The parent's own wait settings are dropped: ``import loraplex`` in the parent
    already set ``GOMP_SPINCOUNT``, and each child must measure its own setting."""
    env = {k: v for k, v in base.items() if k not in (*OMP_WAIT_ENV, spin_env)}
    root = str(Path(__file__).resolve().parents[2])  # where this loraplex is imported from
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH")) if p)
    if spin == "passive":
        env["OMP_WAIT_POLICY"] = "passive"  # loraplex then leaves the runtime alone
    elif spin != "engine":  # engine: nothing set, loraplex picks its default
        env[spin_env] = spin
    return env


def vllm_env(base: Mapping[str, str], spin_env: str, kv_cache_gb: int) -> dict[str, str]:
    """vLLM's environment: its runtime's own wait policy (not the spin count ``import loraplex``
    set in this process), ``VLLM_CPU_KVCACHE_SPACE`` in GB."""
    env = {k: v for k, v in base.items() if k not in ("GOMP_SPINCOUNT", spin_env)}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
    return env


class Child:
    """One engine child: JSON commands on its stdin, ``MARK``-ed JSON events on its stdout.

    Its stderr goes to ``log`` (an error names the last line there); any stdout line that is
    not an event to ``<log>.stdout`` (the worker sends the engine's prints to stderr).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        timeout_s: float,
    ) -> None:
        self.name, self.log, self.timeout_s = name, log, timeout_s
        self._log_file = log.open("a", buffering=1)
        self._stray = log.with_name(f"{log.name}.stdout").open("a", buffering=1)
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            env=dict(env),
            text=True,
            bufsize=1,
        )
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            if line.startswith(MARK):
                self._events.put(json.loads(line[len(MARK) :]))
            else:
                self._stray.write(line)
        self._events.put(None)  # end of output: the child exited

    def expect(self, event: str) -> dict[str, Any]:
        """The child's next event, which must be ``event``."""
        try:
            got = self._events.get(timeout=self.timeout_s)
        except queue.Empty:
            raise ChildError(f"{self.name} did not answer in {self.timeout_s:g} s") from None
        if got is None:
            self.proc.wait()
            raise ChildError(
                f"{self.name} exited (code {self.proc.returncode}): {self.last_log_line()}"
            )
        if got["event"] == "error":
            raise ChildError(f"{self.name}: {got['message']}")
        if got["event"] != event:
            raise ChildError(f"{self.name}: expected {event}, got {got['event']}")
        return got

    def call(self, op: str, reply: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it exited: expect() says why
        return self.expect(reply)

    def last_log_line(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines()]
        last = next((ln for ln in reversed(lines) if ln), "")
        return last or "no output"

    def close(self, grace_s: float = 30.0) -> None:
        """Ask the child to exit; kill it if it has not within ``grace_s``."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        self._log_file.close()
        self._stray.close()

    def keep_log(self, dest: Path) -> Path:
        """Copy the log, then any stray stdout (for a failed run's report)."""
        for f in (self._log_file, self._stray):
            if not f.closed:
                f.flush()
        shutil.copyfile(self.log, dest)
        stray = Path(self._stray.name).read_text(errors="replace")
        if stray:
            with dest.open("a") as out:
                out.write(f"\n---- stdout (not events) ----\n{stray}")
        return dest


@contextmanager
def busy_processes(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` separate Python processes, each spinning ``while True: pass``; yielded once all of
    them run their loop, killed (and reaped) when the block ends, however it ends."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-S", "-c", BUSY_CODE, str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                )
            )
        for p in procs:
            assert p.stdout is not None
            if p.stdout.read(1) != b".":
                raise ChildError(f"busy process {p.pid} did not start (code {p.wait()})")
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


def is_running(pid: int) -> bool:
    """Whether a process ``pid`` exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@contextmanager
def frozen(roots: Sequence[int]) -> Iterator[None]:
    """Stop (SIGSTOP) the process trees of ``roots`` for the block, then continue them. The
    other system's idle engine must not run beside a timed run: an idle vLLM child still polls,
    and beside it loraplex's quiet workload lost a sixth or more of its tokens/s on 2 cores
    (figures in docs/benchmarks.md, "contention")."""
    stopped: list[int] = []
    try:
        for root in roots:
            for pid in sorted(tree_pids(root)):
                try:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                except ProcessLookupError:
                    pass
        _wait_stopped(stopped)
        yield
    finally:
        for pid in stopped:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _wait_stopped(pids: Sequence[int], timeout_s: float = 5.0) -> None:
    """Until every process of ``pids`` that still exists is stopped (a signal is delivered when
    the process next runs, not when it is sent); at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    waiting = list(pids)
    while waiting and time.monotonic() < deadline:
        waiting = [pid for pid in waiting if _state(pid) not in ("T", "t", "Z", "X", None)]
        if waiting:
            time.sleep(0.005)


def _state(pid: int) -> str | None:
    """The one-letter state of process ``pid`` in /proc (None: gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
