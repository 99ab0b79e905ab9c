"""Rows handed over on the request path without I/O, written in batches by one background task.

The usage recorder (``usage.py``) and the request log (``request_log_writer.py``) both need it:
``push`` appends to a bounded in-memory queue and wakes the writer once a batch is full; the
writer writes at most ``batch_size`` rows per database call, every ``flush_interval`` seconds
or sooner; a batch the database refuses goes back to the front of the queue, in order, and is
tried again after ``flush_interval``. Past ``max_pending`` rows (the database slow or down) a
row is dropped and counted in ``dropped``: the oldest one (``drop_oldest``) or the new one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from contextlib import suppress
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BatchWriter(Generic[T]):
    """Subclasses write a batch in ``_write_batch`` (returning the rows written) and raise to
    have it kept and tried again."""

    def __init__(
        self,
        name: str,
        *,
        max_pending: int,
        batch_size: int,
        flush_interval: float,
        drop_oldest: bool,
    ) -> None:
        self.name = name  # in log lines and the task's name
        self.max_pending = max_pending
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.drop_oldest = drop_oldest
        self.dropped = 0  # rows lost to a full queue, since start
        self.written = 0
        self._queue: deque[T] = deque()
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    async def _write_batch(self, batch: list[T]) -> int:
        raise NotImplementedError

    # -- the request path: no I/O --

    def push(self, row: T) -> None:
        if len(self._queue) >= self.max_pending:
            self.dropped += 1
            if self.dropped % 1000 == 1:
                logger.error("%s queue full (database slow or down): %d rows dropped so far",
                             self.name, self.dropped)  # fmt: skip
            if not self.drop_oldest:
                return
            self._queue.popleft()
        self._queue.append(row)
        if len(self._queue) >= self.batch_size:
            self._wake.set()
        if (self._task is None or self._task.done()) and not self._closing:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no event loop (a synchronous caller): ``flush`` writes it later
            self._task = loop.create_task(self._flusher(), name=f"{self.name}-writer")

    @property
    def pending(self) -> int:
        return len(self._queue)

    # -- the background writer --

    async def _flusher(self) -> None:
        while self._queue and not self._closing:
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_interval)
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # never let the writer die with rows queued: retry later
                logger.exception("writing %s rows failed; retrying", self.name)
                await asyncio.sleep(self.flush_interval)

    async def flush(self) -> int:
        """Write every queued row now; returns how many. Rows a failing database refused stay
        queued, in order, for the next flush."""
        written = 0
        async with self._flush_lock:
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]  # fmt: skip
                try:
                    written += await self._write_batch(batch)
                except Exception:
                    self._queue.extendleft(reversed(batch))
                    raise
        self.written += written
        return written

    async def close(self) -> None:
        """Stop the writer (without interrupting a write) and write the rest."""
        self._closing = True
        self._wake.set()
        task = self._task
        if task is not None and not task.done():
            await asyncio.gather(task, return_exceptions=True)
        await self.flush()
        self._closing = False
