"""``DatabaseQuotaStore``: the quota windows in the ``quota_leases`` table, shared by every
platform replica on one database, so a tenant's limits hold across all of them together.

One row per admitted request of a limited tenant (a tenant with no limit writes nothing).
Admission is one transaction that serializes per tenant and decides with the rules of
``loraplex.platform.quotas`` (``refusal``, ``rate_headers``) on a ``Window`` read from the rows:

    PostgreSQL   SELECT ... FROM tenants WHERE id = :tenant FOR NO KEY UPDATE   (waits for the
                 tenant's other admissions to commit; foreign-key checks of other writes on the
                 tenant's rows are not blocked)
    SQLite       the INSERT of the new lease, first, takes the database's write lock
    both         INSERT the lease; read the window without it; refused: ROLLBACK, else COMMIT

so no two replicas can both take the last slot. The work runs in a worker thread
(``Database.run``); the event loop never waits on a lock. ``release`` (called from the request
log, which cannot wait) schedules the UPDATE that finishes the lease; ``close`` waits for them.
A release lands a few milliseconds after the response ended; the replica's next admission of
that tenant waits for it, so one replica never races its own releases (another replica sees
them once they commit).

A lease is in flight while ``finished_at`` is NULL and ``expires_at`` is ahead. Each replica
renews its open leases' ``expires_at`` every ``ttl / 3`` seconds (``maintain_forever``, started
by the platform's lifespan); a replica that dies stops renewing, and its requests stop counting
against concurrency and tokens-in-flight after at most ``ttl`` seconds. Their admissions still
count for requests/minute until they leave the window. The same task prunes rows no window
reads any more: finished ones that left the window, and expired ones admitted before it.

Times are epoch seconds of each replica's clock: replicas need synchronized clocks (NTP); a skew
of ``s`` seconds moves the window edge by ``s`` for the requests of the skewed replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import and_, case, delete, func, or_, select, update
from sqlalchemy.orm import Session

from loraplex.platform.db.database import Database
from loraplex.platform.db.models import QuotaLease, Tenant
from loraplex.platform.quotas import WINDOW_S, Limits, Window, rate_headers, refusal

logger = logging.getLogger(__name__)

LEASE_TTL_S = 30.0


@dataclass(frozen=True)
class _Row:
    """A lease this replica holds: its row id and tenant (``None`` id: an unlimited tenant's
    request, which has no row)."""

    lease_id: int | None
    tenant_id: int


class DatabaseQuotaStore:
    """See the module docstring. ``replica_id``: this process's name in the rows (default: a
    fresh random one); ``clock``: epoch seconds (tests share a fake one between replicas)."""

    def __init__(
        self,
        db: Database,
        *,
        replica_id: str | None = None,
        window: float = WINDOW_S,
        lease_ttl: float = LEASE_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self.replica_id = replica_id or uuid.uuid4().hex
        self.window = window
        self.lease_ttl = lease_ttl
        self.clock = clock
        self._open: dict[int, int] = {}  # tenant id -> this replica's leases not yet finished
        self._releases: dict[int, set[asyncio.Task[None]]] = {}  # tenant id -> releases

    # ---- admission ---------------------------------------------------------------------------

    async def admit(
        self, tenant_id: int, limits: Limits, estimate: int
    ) -> tuple[object, dict[str, str]]:
        if limits.unlimited:
            row = _Row(None, tenant_id)
            headers: dict[str, str] = {}
        else:
            pending = self._releases.get(tenant_id)
            if pending:  # this replica's own releases land first: no race with itself
                await asyncio.wait(set(pending))
            lease_id, headers = await self.db.run(
                lambda s: self._admit(s, tenant_id, limits, estimate)
            )
            row = _Row(lease_id, tenant_id)
        self._open[tenant_id] = self._open.get(tenant_id, 0) + 1
        return row, headers

    def _admit(
        self, session: Session, tenant_id: int, limits: Limits, estimate: int
    ) -> tuple[int, dict[str, str]]:
        if not self.db.is_sqlite:  # SQLite: the INSERT below is the lock
            session.execute(
                select(Tenant.id).where(Tenant.id == tenant_id).with_for_update(key_share=True)
            )
        lease = QuotaLease(
            tenant_id=tenant_id,
            replica_id=self.replica_id,
            admitted_at=0.0,
            estimated_tokens=estimate,
            expires_at=0.0,
        )
        session.add(lease)
        session.flush()
        # The clock is read with the lock held (on SQLite the INSERT took it), so no admission
        # another replica committed meanwhile is newer than this one's ``now``.
        now = self.clock()
        lease.admitted_at, lease.expires_at = now, now + self.lease_ttl
        session.flush()
        window = self._window(session, tenant_id, limits.requests_per_minute, now, lease.id)
        error = refusal(window, limits, now, self.window)
        if error is not None:
            raise error  # rolls the lease back
        return lease.id, rate_headers(window.admitting(now, estimate), limits, now, self.window)

    def _window(
        self, session: Session, tenant_id: int, rpm: int | None, now: float, exclude: int
    ) -> Window:
        """The tenant's window at ``now`` from its rows, without the lease ``exclude``."""
        lease = QuotaLease
        horizon = now - self.window
        mine = and_(lease.tenant_id == tenant_id, lease.id != exclude)
        in_window = lease.admitted_at > horizon
        finished = and_(lease.finished_at > horizon, lease.actual_tokens > 0)
        live = and_(lease.finished_at.is_(None), lease.expires_at > now)
        requests, newest, used, newest_tokens, reserved, in_flight = session.execute(
            select(
                func.coalesce(func.sum(case((in_window, 1), else_=0)), 0),
                func.max(case((in_window, lease.admitted_at))),
                func.coalesce(func.sum(case((finished, lease.actual_tokens), else_=0)), 0),
                func.max(case((finished, lease.finished_at))),
                func.coalesce(func.sum(case((live, lease.estimated_tokens), else_=0)), 0),
                func.coalesce(func.sum(case((live, 1), else_=0)), 0),
            ).where(mine)
        ).one()
        edge = None
        if rpm and requests >= rpm:
            edge = session.scalar(
                select(lease.admitted_at)
                .where(mine, in_window)
                .order_by(lease.admitted_at.desc())
                .offset(rpm - 1)
                .limit(1)
            )

        def finished_rows() -> list[tuple[float, int]]:
            rows = session.execute(
                select(lease.finished_at, lease.actual_tokens)
                .where(mine, finished)
                .order_by(lease.finished_at)
            )
            return [(float(at or 0.0), int(n or 0)) for at, n in rows]  # both set here

        return Window(
            requests=int(requests),
            rpm_edge=edge,
            newest_request=newest,
            tokens_used=int(used),
            newest_tokens=newest_tokens,
            reserved=int(reserved),
            in_flight=int(in_flight),
            finished=finished_rows,
        )

    # ---- release -----------------------------------------------------------------------------

    def release(self, handle: object, actual_tokens: int) -> None:
        assert isinstance(handle, _Row)
        left = self._open.get(handle.tenant_id, 0) - 1
        if left > 0:
            self._open[handle.tenant_id] = left
        else:
            self._open.pop(handle.tenant_id, None)
        if handle.lease_id is None:
            return
        now = self.clock()
        lease_id = handle.lease_id

        def finish(session: Session) -> None:
            session.execute(
                update(QuotaLease)
                .where(QuotaLease.id == lease_id)
                .values(finished_at=now, actual_tokens=actual_tokens)
            )

        self._write_later(handle.tenant_id, finish, lease_id)

    def narrow(self, handle: object, estimate: int) -> None:
        """Lower an open lease's reservation (``Lease.narrow``), as ``release`` writes: later,
        and before this replica's next admission of the tenant."""
        assert isinstance(handle, _Row)
        if handle.lease_id is None:
            return
        lease_id = handle.lease_id

        def lower(session: Session) -> None:
            session.execute(
                update(QuotaLease)
                .where(QuotaLease.id == lease_id, QuotaLease.estimated_tokens > estimate)
                .values(estimated_tokens=estimate)
            )

        self._write_later(handle.tenant_id, lower, lease_id)

    def _write_later(self, tenant_id: int, write: Callable[[Session], None], lease_id: int) -> None:
        """Run ``write`` in a worker thread; the tenant's next admission here waits for it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop (a script): nothing to block
            self.db.call(write)
            return
        task = loop.create_task(self._finish(write, lease_id))
        tasks = self._releases.setdefault(tenant_id, set())
        tasks.add(task)
        task.add_done_callback(lambda t: self._forget_release(tenant_id, t))

    def _forget_release(self, tenant_id: int, task: asyncio.Task[None]) -> None:
        tasks = self._releases.get(tenant_id)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._releases[tenant_id]

    async def _finish(self, finish: Callable[[Session], None], lease_id: int) -> None:
        try:
            await self.db.run(finish)
        except Exception:  # the lease expires by itself when its heartbeat stops (ttl)
            logger.exception("quota lease %d could not be written; it expires in time", lease_id)

    def in_flight(self, tenant_id: int) -> int:
        return self._open.get(tenant_id, 0)

    def forget(self, tenant_id: int) -> None:
        self._open.pop(tenant_id, None)  # the rows went with the tenant (ON DELETE CASCADE)

    async def close(self) -> None:
        """Wait until every release started so far is in the database."""
        while self._releases:
            tasks = [t for group in self._releases.values() for t in group]
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- upkeep ------------------------------------------------------------------------------

    def heartbeat(self, session: Session) -> int:
        """Renew this replica's open leases; returns how many."""
        result = session.execute(
            update(QuotaLease)
            .where(QuotaLease.replica_id == self.replica_id, QuotaLease.finished_at.is_(None))
            .values(expires_at=self.clock() + self.lease_ttl)
        )
        return int(getattr(result, "rowcount", 0) or 0)

    def prune(self, session: Session) -> int:
        """Delete rows no window reads any more; returns how many."""
        now = self.clock()
        horizon = now - self.window
        lease = QuotaLease
        result = session.execute(
            delete(lease).where(
                or_(
                    lease.finished_at <= horizon,
                    and_(
                        lease.finished_at.is_(None),
                        lease.expires_at <= now,
                        lease.admitted_at <= horizon,
                    ),
                )
            )
        )
        return int(getattr(result, "rowcount", 0) or 0)

    async def maintain_forever(self) -> None:
        """Renew this replica's leases and prune old rows every ``lease_ttl / 3`` seconds;
        runs until cancelled (a failed round is logged; the next one tries again)."""
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            try:
                await self.db.run(self.heartbeat)
                await self.db.run(self.prune)
            except Exception:
                logger.exception("renewing or pruning quota leases failed; retrying")
