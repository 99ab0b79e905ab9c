"""Usage accounting: one ``UsageRecord`` row per inference request that reached the engine
(streamed or not, finished, failed or abandoned by its client), daily roll-ups, retention, and
``GET /v1/usage``.

Recording never slows a request: ``UsageRecorder.observe`` (a request-log observer, called when
the response's last byte went out or the client left) only appends a plain record to an
in-memory buffer. A background task writes the buffer in batches (every ``flush_interval``
seconds, sooner when ``batch_size`` rows wait) and exits when the buffer is empty; the next
request starts it again. ``await recorder.flush()`` writes everything now (tests, shutdown).
A process killed hard loses at most the rows of the last ``flush_interval`` seconds.

Rows: the caller's tenant and key (resolved from the key's public id at write time, through the
tenant's ``TenantScope``, so a row can only name the tenant's own key and adapter version), the
adapter version (``model`` is then ``"<adapter>@<N>"``; else the served name, the base model's
for base requests), the request id, endpoint, prompt/completion/cached tokens, latency, time to
first token and the HTTP status (499: the client left; its tokens are those actually produced).

Retention: raw rows older than ``usage_retention_days`` (whole UTC days) are added to
``UsageDaily`` (tenant, day, model) and deleted in the same transaction, so every request is
counted in exactly one of the two tables; reports add both without double counting.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

from pydantic import BaseModel
from sqlalchemy import Date, Select, and_, case, delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from loraplex.platform.batch_writer import BatchWriter
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import (
    Adapter,
    AdapterVersion,
    ApiKey,
    Tenant,
    UsageDaily,
    UsageRecord,
    utcnow,
)
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.errors import APIError
from loraplex.platform.request_log import CLIENT_CLOSED, RequestRecord

logger = logging.getLogger(__name__)

USAGE_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions"})
MAX_RANGE_DAYS = 366
DEFAULT_RANGE_DAYS = 30
# The days a report may name: every date arithmetic on them (a default start 29 days back, an
# end's next midnight) stays inside what ``datetime`` represents.
FIRST_DAY = dt.date(1970, 1, 1)
LAST_DAY = dt.date(9999, 12, 30)
RETENTION_INTERVAL_S = 3600.0


# ---- recording ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PendingUsage:
    """A finished request, waiting in the buffer to become a ``UsageRecord`` row."""

    tenant_id: int | None
    key_public_id: str | None
    adapter_version_id: int | None
    model: str
    request_id: str
    endpoint: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    latency_ms: float
    ttft_ms: float | None
    status: int
    created_at: dt.datetime  # when the request arrived (UTC)


class UsageRecorder(BatchWriter[PendingUsage]):
    def __init__(
        self,
        db: Database,
        *,
        flush_interval: float = 1.0,
        batch_size: int = 500,
        max_buffer: int = 100_000,
    ) -> None:
        # beyond max_buffer rows (the database is down) the oldest rows go
        super().__init__("usage", max_pending=max_buffer, batch_size=batch_size,
                         flush_interval=flush_interval, drop_oldest=True)  # fmt: skip
        self.db = db

    # -- the request path: no I/O --

    def observe(self, record: RequestRecord) -> None:
        """Request-log observer: buffer a row for every inference request that went to the
        engine (``record.generated``), however it ended: finished, failed, or the client left.

        Requests refused before the engine (bad input, an unknown model, a quota's 429) used
        no tokens and get no row; the request log and the metrics count them. So a flood of
        refused requests does not grow the database: rows per tenant are bounded by its
        quotas."""
        if record.path not in USAGE_ENDPOINTS or not record.generated:
            return
        # The serving layer puts the key's public id and the adapter version on the record
        # where it knows them; without them the row has no key / version (the model still is).
        key_id = getattr(record, "key_id", None) or _key_of_caller_id(record.caller or "")
        version_id = getattr(record, "adapter_version_id", None)
        self.record_request(record, key_id=key_id, adapter_version_id=version_id)

    def record_request(
        self,
        record: RequestRecord,
        *,
        key_id: str | None = None,
        adapter_version_id: int | None = None,
    ) -> None:
        """Buffer the usage of the finished request ``record`` (``key_id``: the public id of
        the caller's key)."""
        latency = record.latency()
        ttft = None
        if record.first_token_time is not None:
            ttft = round((record.first_token_time - record.start) * 1000, 3)
        status = record.status if record.status is not None else CLIENT_CLOSED
        if record.stream_error_status is not None:
            status = record.stream_error_status
        self.push(
            PendingUsage(
                tenant_id=int(record.tenant_id) if record.tenant_id is not None else None,
                key_public_id=key_id,
                adapter_version_id=adapter_version_id,
                model=(record.served_model or "-")[:140],
                request_id=(record.request_id or "")[:64],
                endpoint=record.path[:64],
                prompt_tokens=record.prompt_tokens,
                completion_tokens=record.completion_tokens,
                cached_tokens=record.cached_tokens,
                latency_ms=round(latency * 1000, 3),
                ttft_ms=ttft,
                status=status,
                created_at=utcnow() - dt.timedelta(seconds=latency),
            )
        )

    async def _write_batch(self, batch: list[PendingUsage]) -> int:
        try:
            return int(await self.db.run(partial(_write_rows, batch=batch)))
        except IntegrityError:
            # A tenant (or key, version) went away between the request and this write:
            # write tenant by tenant, dropping the rows of a deleted tenant only.
            return await self._write_per_tenant(batch)

    async def _write_per_tenant(self, batch: list[PendingUsage]) -> int:
        written = 0
        by_tenant: dict[int | None, list[PendingUsage]] = {}
        for row in batch:
            by_tenant.setdefault(row.tenant_id, []).append(row)
        for tenant_id, rows in by_tenant.items():
            try:
                written += await self.db.run(partial(_write_rows, batch=rows))
            except IntegrityError:
                logger.warning("dropped %d usage rows of tenant %s: %s", len(rows), tenant_id,
                               "it no longer exists")  # fmt: skip
        return written


def _key_of_caller_id(caller_id: str) -> str | None:
    """The key's public id in a tenant caller id ``tenant:<name>/key:<public id>``."""
    _, sep, key = caller_id.rpartition("/key:")
    return key if sep and caller_id.startswith("tenant:") and key else None


def _write_rows(session: Session, batch: list[PendingUsage]) -> int:
    """Insert ``batch`` (one transaction). Each tenant's rows go through its ``TenantScope``:
    key and adapter version ids are looked up among that tenant's own rows only."""
    written = 0
    by_tenant: dict[int | None, list[PendingUsage]] = {}
    for row in batch:
        by_tenant.setdefault(row.tenant_id, []).append(row)
    for tenant_id, rows in by_tenant.items():
        if tenant_id is None:  # the operator's own requests
            session.add_all(_usage_row(r, None, r.model) for r in rows)
            written += len(rows)
            continue
        if session.get(Tenant, tenant_id) is None:
            continue  # deleted since: its usage went with it
        scope = TenantScope(session, tenant_id)
        keys: dict[str, int] = {}
        public_ids = {r.key_public_id for r in rows if r.key_public_id}
        if public_ids:
            key_query = scope.select(ApiKey).with_only_columns(ApiKey.public_id, ApiKey.id)
            key_query = key_query.where(ApiKey.public_id.in_(public_ids))
            keys = {pid: kid for pid, kid in session.execute(key_query).tuples()}
        names: dict[int, str] = {}
        version_ids = {r.adapter_version_id for r in rows if r.adapter_version_id is not None}
        if version_ids:
            version_query = scope.select_versions().with_only_columns(
                AdapterVersion.id, Adapter.name, AdapterVersion.number
            )
            version_query = version_query.where(AdapterVersion.id.in_(version_ids))
            for version_id, name, number in session.execute(version_query).tuples():
                names[version_id] = f"{name}@{number}"
        for r in rows:
            vid = r.adapter_version_id if r.adapter_version_id in names else None
            model = names[vid] if vid is not None else r.model
            usage = _usage_row(r, keys.get(r.key_public_id or ""), model[:140])
            usage.adapter_version_id = vid
            scope.add(usage)
            written += 1
    session.flush()
    return written


def _usage_row(r: PendingUsage, key_id: int | None, model: str) -> UsageRecord:
    return UsageRecord(
        tenant_id=r.tenant_id,
        api_key_id=key_id,
        adapter_version_id=None,
        model=model,
        request_id=r.request_id,
        endpoint=r.endpoint,
        prompt_tokens=r.prompt_tokens,
        completion_tokens=r.completion_tokens,
        cached_tokens=r.cached_tokens,
        latency_ms=r.latency_ms,
        ttft_ms=r.ttft_ms,
        status=r.status,
        created_at=r.created_at,
    )


# ---- roll-ups and retention --------------------------------------------------------------------


def utc_day(column: Any, session: Session) -> ColumnElement[dt.date]:
    """The UTC calendar day of a timestamp column, in the session's SQL dialect."""
    if session.get_bind().dialect.name == "postgresql":
        # timestamptz -> timestamp in UTC, whatever the connection's time zone.
        return func.date(func.timezone("UTC", column), type_=Date)
    return func.date(column, type_=Date)  # SQLite stores UTC text: 'YYYY-MM-DD HH:MM:SS...'


def _is_error() -> ColumnElement[int]:
    """1 for a failed request: a 4xx/5xx status, except 499 (the client left; billed)."""
    status = UsageRecord.status
    return case((and_(status >= 400, status != CLIENT_CLOSED), 1), else_=0)


def roll_up(session: Session, cutoff: dt.datetime) -> int:
    """Move raw usage rows created before ``cutoff`` into ``UsageDaily``; returns how many raw
    rows went. One transaction: a request is in exactly one of the two tables at any time."""
    # Rows up to this id only: one written while we work is left for the next run.
    last_id = session.scalar(
        select(func.max(UsageRecord.id)).where(UsageRecord.created_at < cutoff)
    )
    if last_id is None:
        return 0
    old = and_(UsageRecord.created_at < cutoff, UsageRecord.id <= last_id)
    day = utc_day(UsageRecord.created_at, session).label("day")
    groups = session.execute(
        select(
            UsageRecord.tenant_id,
            day,
            UsageRecord.model,
            func.count(),
            func.sum(_is_error()),
            func.sum(UsageRecord.prompt_tokens),
            func.sum(UsageRecord.completion_tokens),
        )
        .where(old)
        .group_by(UsageRecord.tenant_id, day, UsageRecord.model)
    ).all()
    days = {g[1] for g in groups}
    existing = {
        (d.tenant_id, d.day, d.model): d
        for d in session.scalars(select(UsageDaily).where(UsageDaily.day.in_(days)))
    }
    moved = 0
    for tenant_id, d, model, requests, errors, prompt, completion in groups:
        daily = existing.get((tenant_id, d, model))
        if daily is None:
            daily = UsageDaily(
                tenant_id=tenant_id, day=d, model=model, requests=0, errors=0,
                prompt_tokens=0, completion_tokens=0,
            )  # fmt: skip
            session.add(daily)
            existing[(tenant_id, d, model)] = daily
        daily.requests += int(requests)
        daily.errors += int(errors or 0)
        daily.prompt_tokens += int(prompt or 0)
        daily.completion_tokens += int(completion or 0)
        moved += int(requests)
    session.flush()
    session.execute(delete(UsageRecord).where(old))
    return moved


def retention_cutoff(retention_days: int, now: dt.datetime | None = None) -> dt.datetime:
    """The start (UTC midnight) of the oldest day whose raw rows are kept."""
    now = now or utcnow()
    day = now.astimezone(dt.timezone.utc).date() - dt.timedelta(days=retention_days)
    return dt.datetime.combine(day, dt.time(), tzinfo=dt.timezone.utc)


async def apply_retention(db: Database, retention_days: int, now: dt.datetime | None = None) -> int:
    """Roll up and delete the raw rows past the retention; returns how many were moved."""
    cutoff = retention_cutoff(retention_days, now)
    moved = await db.run(partial(roll_up, cutoff=cutoff))
    if moved:
        logger.info("usage: rolled up %d raw rows older than %s", moved, cutoff.date())
    return moved


async def retention_loop(db: Database, retention_days: int, interval: float) -> None:
    """``apply_retention`` now and every ``interval`` seconds, until cancelled."""
    while True:
        try:
            await apply_retention(db, retention_days)
        except Exception:
            logger.exception("usage retention failed; retrying in %.0f s", interval)
        await asyncio.sleep(interval)


# ---- reports -----------------------------------------------------------------------------------


class UsageBucket(BaseModel):
    date: dt.date
    model: str
    tenant: str | None = None  # only in reports across tenants
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class UsageTotals(BaseModel):
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class UsageReport(BaseModel):
    object: str = "usage"
    start: dt.date
    end: dt.date
    data: list[UsageBucket]
    totals: UsageTotals


@dataclass(frozen=True)
class DateRange:
    """UTC days ``start`` to ``end``, both included."""

    start: dt.date
    end: dt.date

    @property
    def since(self) -> dt.datetime:
        return dt.datetime.combine(self.start, dt.time(), tzinfo=dt.timezone.utc)

    @property
    def until(self) -> dt.datetime:
        return self.since + dt.timedelta(days=(self.end - self.start).days + 1)


def _parse_day(value: str | None, param: str) -> dt.date | None:
    if value is None or value == "":
        return None
    try:
        if len(value) != 10:
            raise ValueError(value)
        day = dt.date.fromisoformat(value)
        if not FIRST_DAY <= day <= LAST_DAY:
            raise ValueError(value)
    except ValueError:
        raise APIError(
            400,
            f"{param} must be a date as YYYY-MM-DD (UTC) from {FIRST_DAY} to {LAST_DAY}, for "
            f"example {utcnow().date().isoformat()!r}; got {value[:40]!r}.",
            param=param,
            code="invalid_date",
        ) from None
    return day


def parse_range(start: str | None, end: str | None, today: dt.date | None = None) -> DateRange:
    """``start``/``end`` query values (inclusive, UTC); default the last 30 days to today."""
    first, last = _parse_day(start, "start"), _parse_day(end, "end")
    today = today or utcnow().date()
    if last is None:
        last = max(today, first) if first is not None else today
    if first is None:
        first = last - dt.timedelta(days=DEFAULT_RANGE_DAYS - 1)
    if first > last:
        raise APIError(
            400,
            f"start ({first}) is after end ({last}); swap them.",
            param="start",
            code="invalid_date_range",
        )
    if (last - first).days + 1 > MAX_RANGE_DAYS:
        raise APIError(
            400,
            f"The range {first} to {last} spans more than {MAX_RANGE_DAYS} days; ask for it "
            "in parts.",
            param="start",
            code="invalid_date_range",
        )
    return DateRange(first, last)


_Key = tuple[int | None, dt.date, str]


def _raw_totals(
    session: Session, base: Select[Any], days: DateRange, by_tenant: bool
) -> Iterable[tuple[_Key, tuple[int, int, int, int]]]:
    day = utc_day(UsageRecord.created_at, session).label("day")
    tenant_col = UsageRecord.tenant_id if by_tenant else None
    cols: list[Any] = [day, UsageRecord.model]
    group: list[Any] = [day, UsageRecord.model]
    if tenant_col is not None:
        cols.append(tenant_col)
        group.append(tenant_col)
    query = (
        base.with_only_columns(
            *cols,
            func.count(),
            func.sum(_is_error()),
            func.sum(UsageRecord.prompt_tokens),
            func.sum(UsageRecord.completion_tokens),
        )
        .where(UsageRecord.created_at >= days.since, UsageRecord.created_at < days.until)
        .group_by(*group)
    )
    for row in session.execute(query):
        tenant = row[2] if by_tenant else None
        n = 3 if by_tenant else 2
        counts = (int(row[n]), int(row[n + 1] or 0), int(row[n + 2] or 0), int(row[n + 3] or 0))
        yield (tenant, row[0], row[1]), counts


def _daily_totals(
    session: Session, base: Select[Any], days: DateRange
) -> Iterable[tuple[_Key, tuple[int, int, int, int]]]:
    query = base.where(UsageDaily.day >= days.start, UsageDaily.day <= days.end)
    for d in session.scalars(query):
        assert isinstance(d, UsageDaily)
        counts = (d.requests, d.errors, d.prompt_tokens, d.completion_tokens)
        yield (d.tenant_id, d.day, d.model), counts


def _report(
    parts: Iterable[Iterable[tuple[_Key, tuple[int, int, int, int]]]],
    days: DateRange,
    tenant_names: Callable[[set[int]], dict[int, str]] | None,
) -> UsageReport:
    sums: dict[_Key, list[int]] = {}
    for part in parts:
        for key, counts in part:
            acc = sums.setdefault(key, [0, 0, 0, 0])
            for i, v in enumerate(counts):
                acc[i] += v
    names: dict[int, str] = {}
    if tenant_names is not None:
        names = tenant_names({t for t, _, _ in sums if t is not None})
    data = []
    totals = UsageTotals()
    for (tenant, day, model), (requests, errors, prompt, completion) in sorted(
        sums.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0] or 0)
    ):
        bucket = UsageBucket(
            date=day, model=model, requests=requests, errors=errors, prompt_tokens=prompt,
            completion_tokens=completion, total_tokens=prompt + completion,
        )  # fmt: skip
        if tenant_names is not None:
            bucket.tenant = names.get(tenant, "-") if tenant is not None else "-"
        data.append(bucket)
        totals.requests += requests
        totals.errors += errors
        totals.prompt_tokens += prompt
        totals.completion_tokens += completion
        totals.total_tokens += prompt + completion
    return UsageReport(start=days.start, end=days.end, data=data, totals=totals)


def tenant_usage(session: Session, tenant_id: int, days: DateRange) -> UsageReport:
    """One tenant's usage by day and model: its roll-ups plus its raw rows (disjoint)."""
    scope = TenantScope(session, tenant_id)
    raw = _raw_totals(session, scope.select(UsageRecord), days, by_tenant=False)
    daily = _daily_totals(session, scope.select(UsageDaily), days)
    return _report([list(raw), list(daily)], days, None)


def all_usage(session: Session, days: DateRange) -> UsageReport:
    """Every tenant's usage (the operator's view) by day, tenant and model; ``tenant`` "-" is
    the operator's own requests."""
    raw = _raw_totals(session, select(UsageRecord), days, by_tenant=True)
    daily = _daily_totals(session, select(UsageDaily), days)

    def names(ids: set[int]) -> dict[int, str]:
        if not ids:
            return {}
        rows = session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(ids)))
        return {tid: name for tid, name in rows.tuples()}

    return _report([list(raw), list(daily)], days, names)
