"""``RequestLogWriter``: the stored request log's rows, written off the request path.

``observe`` (a request-log observer, see ``request_log.RequestLogMiddleware``) turns a finished
``/v1/`` request into a plain ``PendingEntry`` and appends it to a bounded queue: no I/O, no
lock. A background task writes the queue in batches (every ``flush_interval`` seconds, sooner
when ``batch_size`` rows wait) and stops when it is empty; the next request starts it again.
When the queue is full (the database is down or slow) the new row is dropped and counted
(``dropped``; ``loraplex_request_log_dropped_total`` in /metrics): a request never waits for
the log.

Which requests get a row: every ``/v1/`` request whose tenant is known (answered or refused:
a 404 model, a 422 body, a 429 quota) and the operator's own. A refused key (401: revoked,
expired, a wrong secret) is logged under the tenant of the key its public id names, so an
operator sees a tenant's failing integration; a request without a key, or with one whose public
id names no key, is not logged (anyone can send those; the metrics count them).

Bodies: ``body_cap`` tells the middleware, from an in-memory copy of the opt-ins
(``request_log_settings``; refreshed every ``CAPS_REFRESH_S`` and at once on this replica's
changes), how much of each body to keep for the caller's tenant.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform import request_logs
from loraplex.platform.batch_writer import BatchWriter
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import ApiKey, RequestLogEntry, Tenant, utcnow
from loraplex.platform.request_log import CLIENT_CLOSED, LOGGED_PREFIX, RequestRecord

logger = logging.getLogger(__name__)

CAPS_REFRESH_S = 10.0  # other replicas' changes to the body opt-ins reach this one within it
PURGE_EVERY_S = 3600.0


@dataclass(frozen=True)
class PendingEntry:
    """A finished request waiting to become a ``RequestLogEntry`` row."""

    created_at: dt.datetime  # its arrival (UTC)
    tenant_id: int | None
    key_id: str | None
    presented_key: str | None  # a refused key's public id: its tenant is found at write time
    method: str
    endpoint: str
    model: str | None
    served_model: str | None
    status: int
    error_code: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    duration_ms: float
    finish_reason: str | None
    request_id: str
    stream: bool
    request_body: str | None
    response_body: str | None


def _storable(text: str) -> str:
    """``text`` with U+FFFD for each NUL: PostgreSQL's text refuses NUL, and one refused row
    would fail its whole batch, every tenant's rows with it (callers choose model names,
    paths and bodies)."""
    return text.replace("\x00", "\ufffd")


def _text(body: bytes | None) -> str | None:
    # Cut at a byte cap, a body may end inside a character: that character goes.
    return _storable(body.decode("utf-8", "ignore")) if body is not None else None


def pending_entry(record: RequestRecord) -> PendingEntry | None:
    """The row of ``record``, or None when it gets none (see the module's docstring)."""
    if not record.path.startswith(LOGGED_PREFIX):
        return None
    tenant_id = int(record.tenant_id) if record.tenant_id is not None else None
    if tenant_id is None and record.presented_key is None and record.caller is None:
        return None  # nobody we know
    latency = record.latency()
    ttft = None
    if record.first_token_time is not None:
        ttft = round((record.first_token_time - record.start) * 1000, 3)
    status = record.status if record.status is not None else CLIENT_CLOSED
    if record.stream_error_status is not None:
        status = record.stream_error_status
    reasons = ",".join(dict.fromkeys(record.finish_reasons)) or None
    return PendingEntry(
        created_at=utcnow() - dt.timedelta(seconds=latency),
        tenant_id=tenant_id,
        key_id=(record.key_id or None) and record.key_id[:32],
        presented_key=record.presented_key,
        method=record.method[:8],
        endpoint=_storable(record.path[:64]),
        model=_storable(record.model[:140]) if isinstance(record.model, str) else None,
        served_model=record.served_model[:140] if record.served_model else None,
        status=status,
        error_code=record.error_code[:64] if record.error_code else None,
        prompt_tokens=record.prompt_tokens,
        completion_tokens=record.completion_tokens,
        ttft_ms=ttft,
        duration_ms=round(latency * 1000, 3),
        finish_reason=reasons[:64] if reasons else None,
        request_id=(record.request_id or "")[:64],
        stream=record.stream,
        request_body=_text(record.request_body),
        response_body=_text(record.response_body),
    )


class RequestLogWriter(BatchWriter[PendingEntry]):
    def __init__(
        self,
        db: Database,
        *,
        retention_days: int,
        max_queue: int = 10_000,
        batch_size: int = 500,
        flush_interval: float = 0.5,
    ) -> None:
        # past max_queue rows the new ones are dropped (counted in ``dropped``)
        super().__init__("request log", max_pending=max_queue, batch_size=batch_size,
                         flush_interval=flush_interval, drop_oldest=False)  # fmt: skip
        self.db = db
        self.retention_days = retention_days
        self.caps: dict[int, int] = {}  # tenant id -> bytes of each body kept (opted in)

    # -- the request path: no I/O --

    def body_cap(self, record: RequestRecord) -> int | None:
        """``request_log.BodyCap``: the cap of the caller's tenant, None where it did not opt in."""
        if record.tenant_id is None:
            return None
        return self.caps.get(int(record.tenant_id))

    def observe(self, record: RequestRecord) -> None:
        entry = pending_entry(record)
        if entry is not None:
            self.push(entry)

    async def _write_batch(self, batch: list[PendingEntry]) -> int:
        return int(await self.db.run(partial(_write, batch=batch)))

    # -- upkeep: body opt-ins and retention --

    def load_caps(self) -> None:
        """Read the body opt-ins now (synchronously: at build time, before serving)."""
        self.caps = self.db.call(request_logs.body_caps)

    def set_cap(self, tenant_id: int, cap: int | None) -> None:
        """This replica's own change, in effect for its next request."""
        if cap is None:
            self.caps.pop(tenant_id, None)
        else:
            self.caps[tenant_id] = cap

    async def purge(self, now: dt.datetime | None = None) -> int:
        """Delete the rows past the retention, in short batches; returns how many went."""
        total = 0
        while True:
            n = await self.db.run(
                partial(request_logs.purge, retention_days=self.retention_days, now=now)
            )
            total += n
            if n < request_logs.PURGE_BATCH:
                break
        if total:
            logger.info("request log: purged %d rows older than %d days", total,
                        self.retention_days)  # fmt: skip
        return total

    async def maintain_forever(self) -> None:
        """Refresh the body opt-ins every ``CAPS_REFRESH_S`` and purge every ``PURGE_EVERY_S``
        (the first purge at once), until cancelled."""
        loop = asyncio.get_running_loop()
        next_purge = loop.time()
        while True:
            try:
                self.caps = await self.db.run(request_logs.body_caps)
                if loop.time() >= next_purge:
                    next_purge = loop.time() + PURGE_EVERY_S
                    await self.purge()
            except Exception:
                logger.exception("request log upkeep failed; retrying in %.0f s", CAPS_REFRESH_S)
            await asyncio.sleep(CAPS_REFRESH_S)


# Copied from a ``PendingEntry`` as they are (tenant and key are resolved first).
_COPIED = (
    "method", "endpoint", "model", "served_model", "status", "error_code", "prompt_tokens",
    "completion_tokens", "ttft_ms", "duration_ms", "finish_reason", "request_id", "stream",
    "request_body", "response_body",
)  # fmt: skip


def _write(session: Session, batch: list[PendingEntry]) -> int:
    """Insert ``batch`` (one transaction). A refused key's row goes to the tenant of the key
    its public id names; rows of tenants deleted since (or of no known key) are dropped."""
    presented = {e.presented_key for e in batch if e.tenant_id is None and e.presented_key}
    owners: dict[str, int] = {}
    if presented:
        query = select(ApiKey.public_id, ApiKey.tenant_id).where(ApiKey.public_id.in_(presented))
        owners = {pid: tid for pid, tid in session.execute(query).tuples()}
    tenant_ids = {e.tenant_id for e in batch if e.tenant_id is not None} | set(owners.values())
    alive: set[int] = set()
    if tenant_ids:
        alive = set(session.scalars(select(Tenant.id).where(Tenant.id.in_(tenant_ids))))
    rows = []
    for e in batch:
        tenant_id, key_id = e.tenant_id, e.key_id
        if tenant_id is None and e.presented_key is not None:
            tenant_id = owners.get(e.presented_key)
            if tenant_id is None:
                continue  # no such key: an anonymous caller
            key_id = e.presented_key
        if tenant_id is not None and tenant_id not in alive:
            continue
        row = RequestLogEntry(created_at=e.created_at, tenant_id=tenant_id, key_id=key_id)
        for name in _COPIED:
            setattr(row, name, getattr(e, name))
        rows.append(row)
    session.add_all(rows)
    return len(rows)


class RequestLogCollector:
    """``loraplex_request_log_dropped_total`` and ``loraplex_request_log_queued`` for /metrics."""

    def __init__(self, writer: RequestLogWriter) -> None:
        self.writer = writer

    def describe(self) -> Iterable[Metric]:
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        dropped = CounterMetricFamily(
            "loraplex_request_log_dropped",
            "Request log rows dropped because the write queue was full (the database slow or "
            "down); the requests themselves were served.",
        )
        dropped.add_metric([], self.writer.dropped)
        queued = GaugeMetricFamily(
            "loraplex_request_log_queued", "Request log rows waiting to be written."
        )
        queued.add_metric([], self.writer.pending)
        return [dropped, queued]
