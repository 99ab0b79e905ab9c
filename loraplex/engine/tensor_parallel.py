"""Tensor-parallel ranks: rank 0 is the engine's own process; ranks 1..N-1 are worker processes
it starts, each with its share of the model, its share of the KV cache and of the adapter pool.

    rank 0 (engine process)                          rank r (worker, ``python -m`` this module)
    scheduler, KV manager, adapter residency          --
    runner.execute(out):                              runner.follow(inputs):
      activate slots, StepInputs ── pipe (pickle) ──►   replay pool decisions
      forward  ◄──────── all-reduce per layer ──────►   forward
      logits   ◄──────── gather of vocab shards ─────   logits share
      sample

Two channels: a control pipe per worker (``multiprocessing.connection`` over localhost with a
random auth key) carries setup, adapter loads and each step's ``StepInputs``; the collectives run
on a ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA) made from a ``TCPStore`` that
rank 0 hosts. The pipe is also how a worker knows the engine is gone: EOF, and it exits (on Linux
the kernel also kills it when its parent dies). A worker that dies breaks the next collective or
send on rank 0, which then raises ``TensorParallelError`` naming the rank; collectives time out
after ``COLLECTIVE_TIMEOUT_S`` rather than hang.

Why a pipe for the step's inputs rather than a gloo broadcast: an idle engine's workers wait on
the pipe with no timeout (a collective would time out), and it is cheaper: pickled once and
written to each worker, several times cheaper than gloo's ``broadcast_object_list`` (two
broadcasts; ``python -m benchmarks.tp_control_pipe``, figures in docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import queue
import secrets
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from loraplex.config import EngineConfig
from loraplex.engine.models.parallel import TPGroup
from loraplex.engine.step_inputs import StepInputs

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0  # a collective waiting longer than this fails instead of hanging
STARTUP_TIMEOUT_S = 600.0  # for every worker to start, connect and load its share
_AUTH_ENV = "LORAPLEX_TP_AUTHKEY"
_HOST = "127.0.0.1"


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot run another step."""


# ---- messages: rank 0 -> worker -----------------------------------------------------------


@dataclass(frozen=True)
class _Setup:
    rank: int
    size: int
    store_port: int
    backend: str
    config: EngineConfig
    model_dir: str
    num_threads: int


@dataclass(frozen=True)
class _InitKV:
    pass


@dataclass(frozen=True)
class _AddAdapter:
    name: str
    path: str


@dataclass(frozen=True)
class _Shutdown:
    pass


# ---- messages: worker -> rank 0 -----------------------------------------------------------


@dataclass(frozen=True)
class _Loaded:
    pass


@dataclass(frozen=True)
class _Failed:
    message: str


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)


def _process_group(backend: str, store: Any, rank: int, size: int) -> Any:
    """A gloo or NCCL process group object on ``store`` (not the global default group)."""
    import torch.distributed as dist

    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timeout()
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, _timeout())


class WorkerGroup:
    """Rank 0's handle on ranks 1..N-1 (the runner's ``Followers``)."""

    def __init__(self, procs: dict[int, subprocess.Popen[bytes]], conns: dict[int, Connection]):
        self.procs = procs
        self.conns = conns
        self.broken: str | None = None  # why no further step can run
        self._ready = False
        self._store: Any = None  # rank 0's TCPStore: must outlive the process group
        self._finalizer = weakref.finalize(self, _stop, procs, conns)

    @classmethod
    def start(cls, config: EngineConfig, model_dir: str) -> tuple[WorkerGroup, TPGroup]:
        """Start ranks 1..N-1 (each loads its share in the background) and join them in a
        process group; returns the handle and rank 0's ``TPGroup``."""
        import torch
        import torch.distributed as dist
        from transformers import AutoConfig

        from loraplex.cpu_threads import usable_cpus
        from loraplex.engine.models.loader import resolve_device
        from loraplex.engine.models.parallel import check_shardable

        size = config.model.tensor_parallel_size
        check_shardable(AutoConfig.from_pretrained(model_dir), size)
        device = resolve_device(config.model.device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} GPUs; {torch.cuda.device_count()} "
                "are visible"
            )
        threads = max(1, usable_cpus() // size)  # the ranks share the cores
        torch.set_num_threads(threads)
        store = dist.TCPStore(
            _HOST, 0, size, is_master=True, timeout=_timeout(), wait_for_workers=False
        )
        authkey = secrets.token_bytes(32)
        listener = Listener((_HOST, 0), authkey=authkey)
        host, port = listener.address
        # the workers import this very loraplex (not another one on the default path)
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, _AUTH_ENV: authkey.hex(), "PYTHONPATH": path}
        procs = {
            rank: subprocess.Popen(
                [sys.executable, "-m", __name__, str(rank), host, str(port), str(os.getpid())],
                env=env,
            )
            for rank in range(1, size)
        }
        try:
            conns = _accept(listener, procs)
            for rank, conn in conns.items():
                conn.send(_Setup(rank, size, store.port, backend, config, model_dir, threads))
            group = TPGroup(0, size, _process_group(backend, store, 0, size), backend)
        except BaseException:
            _stop(procs, {})
            raise
        workers = cls(procs, conns)
        workers._store = store  # the store must outlive the process group
        return workers, group

    # ---- Followers --------------------------------------------------------------------------

    def init_kv_cache(self) -> None:
        self._wait_ready()
        self._send_all(_InitKV())

    def step(self, inputs: StepInputs) -> None:
        self._send_bytes(pickle.dumps(inputs, protocol=pickle.HIGHEST_PROTOCOL))

    def check(self, exc: BaseException) -> None:
        if isinstance(exc, TensorParallelError):
            raise exc
        dead = self._dead(wait_s=2.0)
        if dead:
            self.broken = f"tensor-parallel {dead}; the engine cannot run another step"
            raise TensorParallelError(self.broken) from exc

    # ---- adapters ---------------------------------------------------------------------------

    def add_adapter(self, name: str, path: str) -> None:
        """Every rank registers the adapter (reading its files itself); an error names the rank."""
        self._send_all(_AddAdapter(name, path))
        for rank, conn in self.conns.items():
            reply = self._recv(rank, conn)
            if isinstance(reply, _Failed):
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} could not load adapter {name!r}: {reply.message}"
                )

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    def _wait_ready(self) -> None:
        if self._ready:
            return
        for rank, conn in self.conns.items():
            reply = self._recv(rank, conn, timeout_s=STARTUP_TIMEOUT_S)
            if isinstance(reply, _Failed):
                raise TensorParallelError(f"tensor-parallel rank {rank} failed: {reply.message}")
        self._ready = True

    def _send_all(self, msg: object) -> None:
        self._send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_bytes(self, payload: bytes) -> None:
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        dead = self._dead()
        if dead:
            self.broken = f"tensor-parallel {dead}; the engine cannot run another step"
            raise TensorParallelError(self.broken)
        for conn in self.conns.values():
            conn.send_bytes(payload)

    def _recv(self, rank: int, conn: Connection, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Any:
        """The worker's next reply, failing (not hanging) when it dies or takes too long."""
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.2):
            dead = self._dead()
            if dead:
                self.broken = f"tensor-parallel {dead}; the engine cannot run another step"
                raise TensorParallelError(self.broken)
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rank {rank} did not answer in time")
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:
            self.broken = f"tensor-parallel {self._dead(wait_s=2.0) or f'rank {rank} hung up'}"
            raise TensorParallelError(self.broken) from exc

    def _dead(self, wait_s: float = 0.0) -> str:
        """'rank r (pid p) exited with code c' for each dead worker ('' when all live);
        waits up to ``wait_s`` for one to finish dying (its sockets close first)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [
                f"rank {rank} (pid {p.pid}) exited with code {p.returncode}"
                for rank, p in self.procs.items()
                if p.poll() is not None
            ]
            if dead or time.monotonic() >= deadline:
                return ", ".join(dead)
            time.sleep(0.05)


def _accept(listener: Listener, procs: dict[int, subprocess.Popen[bytes]]) -> dict[int, Connection]:
    """Each worker's authenticated connection, by rank; fails when one dies first."""
    arrived: queue.Queue[Connection | BaseException] = queue.Queue()

    def accept_all() -> None:
        try:
            for _ in procs:
                arrived.put(listener.accept())
        except BaseException as exc:  # closed below on failure, or authentication failed
            arrived.put(exc)

    threading.Thread(target=accept_all, daemon=True, name="tp-accept").start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    conns: dict[int, Connection] = {}
    try:
        while len(conns) < len(procs):
            try:
                item = arrived.get(timeout=0.2)
            except queue.Empty:
                dead = [
                    f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
                    for r, p in procs.items()
                    if p.poll() is not None
                ]
                if dead:
                    raise TensorParallelError(
                        f"tensor-parallel {', '.join(dead)} while starting"
                    ) from None
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        "tensor-parallel workers did not connect in time"
                    ) from None
                continue
            if isinstance(item, BaseException):
                raise TensorParallelError(f"tensor-parallel worker connection: {item}") from item
            rank = item.recv()
            conns[int(rank)] = item
    finally:
        listener.close()
    return conns


def _stop(procs: dict[int, subprocess.Popen[bytes]], conns: dict[int, Connection]) -> None:
    """Ask every worker to exit, then make sure it did."""
    for conn in conns.values():
        with contextlib.suppress(OSError, ValueError):  # already gone
            conn.send(_Shutdown())
        conn.close()
    deadline = time.monotonic() + 5.0
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---- the worker side ------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this process when the engine process dies (any way it dies)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # it died before prctl
        os._exit(1)


def worker_main(rank: int, host: str, port: int, parent_pid: int) -> int:
    """A worker rank: connect to rank 0, load this rank's share, follow its steps."""
    _die_with_parent(parent_pid)
    authkey = bytes.fromhex(os.environ.pop(_AUTH_ENV))
    conn = Client((host, port), authkey=authkey)
    conn.send(rank)
    setup: _Setup = conn.recv()
    import torch
    import torch.distributed as dist

    from loraplex.engine.runner import ModelRunner

    torch.set_num_threads(setup.num_threads)
    store = dist.TCPStore(host, setup.store_port, setup.size, is_master=False, timeout=_timeout())
    group = TPGroup(
        rank, setup.size, _process_group(setup.backend, store, rank, setup.size), setup.backend
    )
    cfg = setup.config
    try:
        runner = ModelRunner(
            cfg.model, cfg.cache, cfg.scheduler, setup.model_dir, lora_config=cfg.lora, tp=group
        )
    except Exception as exc:
        conn.send(_Failed(f"{type(exc).__name__}: {exc}"))
        return 1
    conn.send(_Loaded())
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0  # the engine is gone
        if isinstance(msg, StepInputs):
            runner.follow(msg)
        elif isinstance(msg, _InitKV):
            runner.init_kv_cache()
        elif isinstance(msg, _AddAdapter):
            try:
                assert runner.lora is not None
                runner.lora.add_adapter(msg.path, msg.name)
                conn.send(_Loaded())
            except Exception as exc:
                conn.send(_Failed(f"{type(exc).__name__}: {exc}"))
        elif isinstance(msg, _Shutdown):
            return 0


if __name__ == "__main__":
    # the package's own module, not this ``__main__`` copy: the messages unpickle as its classes
    from loraplex.engine.tensor_parallel import worker_main as _main

    try:
        code = _main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's slow teardown
