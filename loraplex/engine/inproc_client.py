"""InprocEngineClient: the engine core in this process, stepped by a background asyncio task.

Each ``core.step()`` runs on the engine's own worker thread so the event loop stays responsive. Every other use
of the core happens on the event loop while no step runs (``_lock``); request adds and aborts are
queued and applied before the next step (or the next call), so ``generate``'s cleanup never waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from loraplex.config import EngineConfig
from loraplex.engine.client import (
    AdapterInfo,
    EngineDeadError,
    EngineStartupError,
    EngineStats,
    StreamingClient,
    check_tenant_weights,
)
from loraplex.engine.request import Request

if TYPE_CHECKING:
    from loraplex.engine.core import EngineCore

logger = logging.getLogger(__name__)
T = TypeVar("T")


class InprocEngineClient(StreamingClient):
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        super().__init__()
        self.config = config
        self.model_dir = model_dir
        self._core: EngineCore | None = None
        self._lock = asyncio.Lock()  # held by each step and by every other use of the core
        self._wakeup = asyncio.Event()
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._dead: str | None = None  # why the step loop stopped, if it crashed
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="loraplex-engine")

    async def start(self) -> None:
        if self._started:
            return
        from loraplex.engine.core import EngineCore  # torch: only once the engine starts

        try:
            core, self.info = await self._in_thread(EngineCore.build, self.config, self.model_dir)
        except Exception as exc:
            raise EngineStartupError(
                f"could not start the engine on {self.model_dir}: {type(exc).__name__}: {exc}"
            ) from exc
        core.set_tenant_weights(self._tenant_weights)  # those given before start
        self._core = core
        self._started = True
        self._task = asyncio.create_task(self._step_loop(), name="loraplex-engine-steps")

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the engine's own thread (never queued behind other executor work)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    @property
    def healthy(self) -> bool:
        return self._started and self._dead is None and self._shutdown is None

    # ---- transport -------------------------------------------------------------------------

    def _send_requests(self, requests: list[Request]) -> None:
        self._pending_adds.extend(requests)
        self._wakeup.set()

    def _send_abort(self, sample_ids: list[str]) -> None:
        self._pending_aborts.extend(sample_ids)
        self._wakeup.set()

    def _apply_pending(self, core: EngineCore) -> None:
        # Adds before aborts: a request aborted right after submission is added, then removed.
        adds, self._pending_adds = self._pending_adds, []
        for req in adds:
            try:
                core.add_request(req)
            except Exception as exc:
                stream = self._sample_of.get(req.request_id)
                if stream is not None:
                    self._send_abort(list(stream.unfinished))
                    self._fail_stream(stream, ValueError(f"{type(exc).__name__}: {exc}"))
        aborts, self._pending_aborts = self._pending_aborts, []
        if aborts:
            core.abort_requests(aborts)

    async def _step_loop(self) -> None:
        core = self._core
        assert core is not None
        while True:
            self._wakeup.clear()  # before looking at the queues: a later set() is never lost
            async with self._lock:
                self._apply_pending(core)
                busy = core.has_unfinished_requests()
                if busy:
                    try:
                        outputs = await self._in_thread(core.step)
                    except Exception as exc:
                        logger.exception("engine step failed; the in-process engine is dead")
                        self._dead = f"the engine failed: {type(exc).__name__}: {exc}"
                        self._fail_all(self._dead)
                        return
            if busy:
                self._dispatch(outputs)
            else:
                await self._wakeup.wait()

    def _use_core(self) -> EngineCore:
        """The core, with queued adds/aborts applied; call with ``_lock`` held."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._core is None:
            raise RuntimeError("the engine client is not started; await start() first")
        self._apply_pending(self._core)
        return self._core

    # ---- adapters, stats, shutdown ---------------------------------------------------------

    async def _load_lora(self, name: str, path: str, pinned: bool) -> AdapterInfo:
        async with self._lock:
            core = self._use_core()
            adapter = await self._in_thread(core.add_lora, name, path, pinned)
        return AdapterInfo.from_adapter(adapter)

    async def _unload_lora(self, key: str) -> None:
        async with self._lock:
            core = self._use_core()
            core.remove_lora(key)

    async def retry_lora(self, key: str) -> bool:
        async with self._lock:
            return self._use_core().retry_lora(key)

    async def stats(self) -> EngineStats:
        async with self._lock:
            core = self._use_core()
            stats = core.stats()
        return self._with_client_stats(stats)

    async def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        self._tenant_weights = check_tenant_weights(weights)
        if self._core is None:  # not started: the core gets them when it is built
            return
        async with self._lock:  # between steps: the next one charges with them
            self._use_core().set_tenant_weights(self._tenant_weights)

    async def _do_shutdown(self, timeout: float) -> None:
        if self._started:
            await self._drain(timeout)
        if self._task is not None:
            async with self._lock:  # the step in flight (if any) completes first
                if self._core is not None:
                    self._apply_pending(self._core)
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._core = None
        self._executor.shutdown(wait=False)
