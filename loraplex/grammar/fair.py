"""Compile workers shared fairly between tenants: one queue per tenant in front of a few threads.

A free thread takes the oldest job of the next tenant in round-robin order, skipping tenants
that already run ``per_tenant`` jobs. Invariants:

* a tenant's jobs start in the order it sent them, and one tenant's slow compiles queue
  behind its own, never in front of another tenant's: with ``t`` tenants waiting, a tenant's
  next job starts within ``t`` job starts;
* a tenant holds at most ``per_tenant`` threads (default ``threads - 1``), so with two threads
  or more one is always open to the other tenants: two 13-second compiles of one tenant leave
  the other thread to everyone else, instead of holding both. The tenant None (no tenant: the
  offline API, a server without tenants) is not capped: it is everyone there.

Used by the engine's compiles (``engine/structured.py``) and the platform's checks. A job's
future is cancelled by ``Future.cancel`` while it waits (a client that went away).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class FairExecutor:
    def __init__(self, threads: int, name: str, per_tenant: int | None = None) -> None:
        if threads < 1:
            raise ValueError(f"a fair executor needs at least one thread, got {threads}")
        self.threads = threads
        self.per_tenant = per_tenant if per_tenant is not None else max(1, threads - 1)
        self._name = name
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # tenant -> its jobs, oldest first; the order of the keys is the round robin's
        self._queues: OrderedDict[Hashable, deque[_Job]] = OrderedDict()
        self._running: dict[Hashable, int] = {}
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, tenant: Hashable, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` for ``tenant`` (None: no tenant, one queue like any other)."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the compile executor is shut down")
            self._queues.setdefault(tenant, deque()).append((future, fn, args))
            if self._idle:
                self._wake.notify()
            elif len(self._workers) < self.threads:
                worker = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._workers)}", daemon=True
                )
                self._workers.append(worker)
                worker.start()
        return future

    @property
    def num_queued(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def shutdown(self, cancel: bool = True) -> None:
        """No new jobs; waiting ones cancelled (``cancel``) or run; workers end when idle."""
        with self._lock:
            self._closed = True
            if cancel:
                for queue in self._queues.values():
                    for future, _, _ in queue:
                        future.cancel()
                self._queues.clear()
            self._wake.notify_all()

    def _next(self) -> tuple[Hashable, _Job] | None:
        """The next job in round-robin order (the lock held); its tenant moves to the back."""
        for tenant in list(self._queues):
            if tenant is not None and self._running.get(tenant, 0) >= self.per_tenant:
                continue
            queue = self._queues.pop(tenant)
            job = queue.popleft()
            if queue:
                self._queues[tenant] = queue  # to the back: the others go first
            return tenant, job
        return None

    def _work(self) -> None:
        while True:
            with self._lock:
                picked = self._next()
                while picked is None:
                    if self._closed and not self._queues:
                        return
                    self._idle += 1
                    self._wake.wait()
                    self._idle -= 1
                    picked = self._next()
                tenant, (future, fn, args) = picked
                self._running[tenant] = self._running.get(tenant, 0) + 1
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as exc:  # the caller reads it from the future
                        future.set_exception(exc)
            finally:
                with self._lock:
                    left = self._running[tenant] - 1
                    if left:
                        self._running[tenant] = left
                    else:
                        del self._running[tenant]
                    if self._queues and self._idle:
                        self._wake.notify()  # a tenant held back by its cap may go now
