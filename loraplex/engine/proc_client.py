"""ProcEngineClient: the engine core in a supervised child process (the default for ``serve``).

    event loop ──► sender thread ──► Pipe ──► engine process (proc_main.run_engine)
    event loop ◄── reader thread ◄── Pipe ◄── one Outputs message per engine step

Supervision: the reader thread sees EOF the moment the child dies (the parent holds no copy of
the child's end of the pipe). Every in-flight request then raises ``EngineDeadError``, ``healthy``
goes False, and a new child is started with the same config, every loaded adapter (same keys)
and the tenant weights last given; ``healthy`` returns to True once it is ready. Each child has a
generation number; messages and EOF from an older generation are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from loraplex.config import EngineConfig
from loraplex.engine.client import (
    AdapterInfo,
    EngineDeadError,
    EngineStartupError,
    EngineStats,
    StreamingClient,
    check_tenant_weights,
)
from loraplex.engine.proc_main import (
    AbortRequests,
    AdapterSpec,
    AddLoRA,
    AddRequests,
    Call,
    Command,
    EngineCall,
    GetStats,
    Message,
    Outputs,
    Placement,
    Ready,
    RemoveLoRA,
    Reply,
    RequestFailed,
    RetryLoRA,
    SetTenantWeights,
    Shutdown,
    StartupFailed,
    default_num_threads,
    run_engine,
)
from loraplex.engine.request import Request

logger = logging.getLogger(__name__)

_MAX_RESTART_DELAY_S = 30.0
R = TypeVar("R")


class _Channel:
    """One child's pipe, served by two daemon threads so the event loop never blocks on it.

    The sender pickles and writes commands in order (a full pipe stalls it, not the loop); the
    reader forwards messages to the loop and reports EOF. The reader owns the connection: it
    closes it only after EOF and after the sender stopped, so no thread ever uses a closed (and
    possibly reused) file descriptor.
    """

    def __init__(
        self,
        conn: Connection,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[Message], None],
        on_eof: Callable[[], None],
    ) -> None:
        self._conn = conn
        self._loop = loop
        self._on_message = on_message
        self._on_eof = on_eof
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, daemon=True)
        self._reader = threading.Thread(target=self._read_loop, daemon=True)

    def start(self, name: str) -> None:
        self._sender.name, self._reader.name = f"{name}-sender", f"{name}-reader"
        self._sender.start()
        self._reader.start()

    def send(self, cmd: Command) -> None:
        self._outbox.put(cmd)

    def _send_loop(self) -> None:
        while (cmd := self._outbox.get()) is not None:
            try:
                self._conn.send(cmd)
            except OSError:
                return  # the child is gone: the reader reports it

    def _read_loop(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                self._loop.call_soon_threadsafe(self._on_message, msg)
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("bad message from the engine process")
        self._outbox.put(None)
        self._sender.join()
        self._conn.close()
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is waiting
            self._loop.call_soon_threadsafe(self._on_eof)


class ProcEngineClient(StreamingClient):
    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        *,
        num_threads: int | None = None,
        join_timeout: float = 5.0,
        startup_timeout: float = 900.0,
        placement: Placement | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model_dir = model_dir
        self.placement = placement  # a data-parallel replica's CPUs (and GPU); None: all
        cpus = placement.cpus if placement is not None else ()
        self.num_threads = num_threads or len(cpus) or default_num_threads()
        self.join_timeout = join_timeout
        self.startup_timeout = startup_timeout
        self.last_restart_seconds: float | None = None  # death seen -> new child ready
        self._died_at: float | None = None  # while restarting: when the death was seen
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: BaseProcess | None = None
        self._channel: _Channel | None = None  # None while no ready child serves requests
        self._generation = 0
        self._ready: asyncio.Future[Ready] | None = None
        self._healthy = False
        self._call_ids = itertools.count()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._restart_task: asyncio.Task[None] | None = None

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def unhealthy_reason(self) -> str | None:
        if self._healthy:
            return None
        if self._shutdown is not None:
            return "the engine is shut down"
        return self._down_reason

    @property
    def process(self) -> BaseProcess | None:
        """The current (or last) engine process."""
        return self._proc

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        await self._spawn()
        self._started = True

    # ---- the child -------------------------------------------------------------------------

    async def _spawn(self) -> None:
        """Start a child and wait until it is ready; ``EngineStartupError`` when it fails."""
        assert self._loop is not None
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe()
        adapters = [
            AdapterSpec(held.name, held.source, held.pinned, held.info.key)
            for held in self._loras.held()
        ]
        weights = dict(self._tenant_weights)
        proc = ctx.Process(
            target=run_engine,
            args=(
                child_conn,
                self.config,
                self.model_dir,
                adapters,
                self.num_threads,
                weights,
                self.placement,
            ),
            name="loraplex-engine",
            daemon=True,
        )
        self._generation += 1
        gen = self._generation
        self._ready = self._loop.create_future()
        self._proc = proc
        await asyncio.to_thread(proc.start)
        child_conn.close()  # only the child holds its end: its death is EOF here
        channel = _Channel(
            parent_conn,
            self._loop,
            functools.partial(self._on_message, gen),
            functools.partial(self._on_eof, gen),
        )
        channel.start(f"loraplex-engine-{gen}")
        self._channel = channel
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.startup_timeout)
        except asyncio.TimeoutError:
            proc.kill()
            raise self._startup_error(
                f"not ready after {self.startup_timeout:.0f} s (the process was killed)"
            ) from None
        finally:
            if not self._healthy:  # failed, timed out or cancelled: this child is not ours
                self._generation += 1
                self._channel = None
                await asyncio.to_thread(proc.join, self.join_timeout)
                if proc.is_alive():
                    proc.kill()
                    await asyncio.to_thread(proc.join, self.join_timeout)
        if self._tenant_weights != weights:  # given while this child was starting
            with contextlib.suppress(EngineDeadError):  # a next child gets them at its start
                await self._call_engine(SetTenantWeights(dict(self._tenant_weights)))

    def _on_ready(self, ready: Ready) -> None:
        # Runs in the same callback as the message: from here on, EOF is a death.
        self.info = ready.info
        for spec, result in ready.adapters:
            if isinstance(result, str) or result.key != spec.key:
                logger.error(
                    "adapter %r (%s) could not be re-added after the engine restarted: %s",
                    spec.name,
                    spec.key[:12],
                    result if isinstance(result, str) else "its files changed",
                )
                self._loras.drop(spec.key)
        self._loras.drop_unowned()
        if self._died_at is not None:  # counted with healthy, in one callback: never seen apart
            self.engine_restarts += 1
            self.last_restart_seconds = time.monotonic() - self._died_at
            self._died_at = None
        self._healthy = True

    def _on_message(self, gen: int, msg: Message) -> None:
        if gen != self._generation:
            return
        if isinstance(msg, Outputs):
            self._dispatch(msg.outputs)
        elif isinstance(msg, Reply):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.error is not None:
                    fut.set_exception(msg.error)
                else:
                    fut.set_result(msg.value)
        elif isinstance(msg, RequestFailed):
            stream = self._sample_of.get(msg.request_id)
            if stream is not None:
                self._send_abort(list(stream.unfinished))
                self._fail_stream(stream, ValueError(msg.message))
        elif self._ready is not None and not self._ready.done():
            if isinstance(msg, Ready):
                self._on_ready(msg)
                self._ready.set_result(msg)
            elif isinstance(msg, StartupFailed):
                self._ready.set_exception(self._startup_error(msg.message))

    def _on_eof(self, gen: int) -> None:
        if gen != self._generation:
            return
        if not self._healthy:  # still starting: _spawn reports it
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(
                    self._startup_error("the engine process exited during startup")
                )
            return
        died_at = time.monotonic()
        self._healthy = False
        self._down_reason = (
            f"the engine process (pid {self.pid}) died at "
            f"{time.strftime('%H:%M:%S')}; "
            + ("restarting it" if self._shutdown is None else "shutting down")
        )
        self._channel = None
        logger.error(
            "the engine process (pid %s) died; failing %d in-flight request(s)%s",
            self.pid, self.num_inflight, "" if self._shutdown else " and restarting it",
        )  # fmt: skip
        message = "the engine process died; the request was lost, retry it"
        self._fail_all(message)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
        self._calls.clear()
        if self._shutdown is None:
            self._restart_task = asyncio.create_task(
                self._restart(died_at), name="loraplex-restart"
            )

    async def _restart(self, died_at: float) -> None:
        if self._proc is not None:
            old = self._proc
            await asyncio.to_thread(old.join, self.join_timeout)
            if old.is_alive():  # it closed the pipe but did not exit
                old.kill()
                await asyncio.to_thread(old.join, self.join_timeout)
            logger.error("engine process %s exited with code %s", old.pid, old.exitcode)
            self._down_reason = (
                f"the engine process (pid {old.pid}) died with exit code {old.exitcode}; "
                "restarting it"
            )
        delay = 0.5
        self._died_at = died_at
        while self._shutdown is None:
            try:
                await self._spawn()
            except EngineStartupError as exc:
                logger.error("engine restart failed (%s); retrying in %.1f s", exc, delay)
                self._down_reason = f"engine restart failed ({exc}); retrying"
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_RESTART_DELAY_S)
                continue
            logger.warning("engine process restarted in %.1f s", self.last_restart_seconds or 0.0)
            return

    def _startup_error(self, why: str) -> EngineStartupError:
        return EngineStartupError(f"could not start the engine on {self.model_dir}: {why}")

    # ---- transport -------------------------------------------------------------------------

    def _send(self, cmd: Command) -> None:
        if self._channel is None:
            raise EngineDeadError("the engine is not available (restarting); retry shortly")
        self._channel.send(cmd)

    def _send_requests(self, requests: list[Request]) -> None:
        self._send(AddRequests(requests))

    def _send_abort(self, sample_ids: list[str]) -> None:
        with contextlib.suppress(EngineDeadError):  # a dead engine holds no blocks
            self._send(AbortRequests(sample_ids))

    async def _call(self, call: EngineCall[R]) -> R:
        if not self._started:
            raise RuntimeError("the engine client is not started; await start() first")
        return await self._call_engine(call)

    async def _call_engine(self, call: EngineCall[R]) -> R:
        """Send ``call`` to the ready child and wait for its reply (also while starting)."""
        if not self._healthy:
            raise EngineDeadError("the engine is not available (restarting); retry shortly")
        assert self._loop is not None
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = fut
        try:
            self._send(Call(call_id, call))
            reply: R = await fut
            return reply
        finally:
            self._calls.pop(call_id, None)

    # ---- adapters, stats, shutdown ---------------------------------------------------------

    async def _load_lora(self, name: str, path: str, pinned: bool) -> AdapterInfo:
        return await self._call(AddLoRA(name, path, pinned))

    async def _unload_lora(self, key: str) -> None:
        await self._call(RemoveLoRA(key))

    async def retry_lora(self, key: str) -> bool:
        return await self._call(RetryLoRA(key))

    async def stats(self) -> EngineStats:
        stats = await self._call(GetStats())
        return self._with_client_stats(stats)

    async def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        self._tenant_weights = check_tenant_weights(weights)
        if self._healthy:  # else the engine gets them when it (re)starts (``_spawn``)
            with contextlib.suppress(EngineDeadError):  # it died meanwhile: the same
                await self._call_engine(SetTenantWeights(dict(self._tenant_weights)))

    async def _do_shutdown(self, timeout: float) -> None:
        if self._started:
            await self._drain(timeout)
        if self._restart_task is not None:
            self._restart_task.cancel()
            await asyncio.gather(self._restart_task, return_exceptions=True)
        self._healthy = False
        self._generation += 1  # from here on, the child's EOF is expected
        if self._channel is not None:
            self._channel.send(Shutdown())
            self._channel = None
        proc = self._proc
        if proc is not None and proc.pid is not None:
            await asyncio.to_thread(proc.join, self.join_timeout)
            if proc.is_alive():
                logger.warning("engine process %s did not stop; terminating it", proc.pid)
                proc.terminate()
                await asyncio.to_thread(proc.join, self.join_timeout)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, self.join_timeout)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError("the engine was shut down"))
        self._calls.clear()
