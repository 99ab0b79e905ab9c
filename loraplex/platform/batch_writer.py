"""Rows handed over on the request path without I/O, written in batches by one background task.

The usage recorder (``usage.py``) and the request log (``request_log_writer.py``) both need it:
``push`` appends to a bounded in-memory queue and wakes the writer once a batch is full; the
writer writes at most ``batch_size`` rows per database call, every ``flush_interval`` seconds
or sooner. A batch that fails because the database is unreachable (``transient``) goes back to
the front of the queue, in order, and is tried again after ``flush_interval``; a batch the
database refuses for its content is written row by row, and a row it refuses alone is dropped
and counted (``rejected``, also in ``dropped``): one bad row never holds up the rows behind it.
Past ``max_pending`` rows (the database slow or down) a row is dropped and counted in
``dropped``: the oldest one (``drop_oldest``) or the new one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from contextlib import suppress
from typing import Generic, TypeVar

from sqlalchemy import exc as sa_exc

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The database did not answer (down, restarting, pool exhausted): the rows are not at fault.
TRANSIENT: tuple[type[BaseException], ...] = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.DisconnectionError,
    sa_exc.TimeoutError,
    TimeoutError,
    OSError,
)


def transient(error: BaseException) -> bool:
    """Whether ``error`` says the database is unreachable rather than refusing the rows."""
    return isinstance(error, TRANSIENT)


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
        self.dropped = 0  # rows lost to a full queue or refused alone, since start
        self.rejected = 0  # rows the database refused alone (counted in ``dropped`` too)
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
        """Write every queued row now; returns how many. Rows an unreachable database could not
        take stay queued, in order, for the next flush; rows it refused are dropped."""
        written = 0
        try:
            async with self._flush_lock:
                while self._queue:
                    batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]  # fmt: skip
                    try:
                        written += await self._write_batch(batch)
                    except Exception as exc:
                        if transient(exc):
                            self._queue.extendleft(reversed(batch))
                            raise
                        written += await self._write_one_by_one(batch)
        finally:
            self.written += written
        return written

    async def _write_one_by_one(self, batch: list[T]) -> int:
        """``batch`` (which the database refused as a whole) row by row: a row
        refused alone is dropped; on a transient error the rest goes back to the queue."""
        written = 0
        for i, row in enumerate(batch):
            try:
                written += await self._write_batch([row])
            except Exception as exc:
                if transient(exc):
                    self._queue.extendleft(reversed(batch[i:]))
                    self.written += written
                    raise
                self.rejected += 1
                self.dropped += 1
                logger.error("%s: the database refused a row, dropped (%d so far): %s",
                             self.name, self.rejected, _brief(exc))  # fmt: skip
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


def _brief(error: BaseException) -> str:
    """The error's type and first line: a log line, not a dump of the statement's rows."""
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:200]}"
