"""The platform's tables (SQLAlchemy 2.0, typed ``Mapped``).

Ownership::

    Tenant ─┬─< ApiKey
            ├─< Adapter ─< AdapterVersion   (immutable, numbered 1, 2, ...; never renumbered)
            ├─< UsageRecord                 (one per request; raw rows kept ``retention`` days)
            └─< UsageDaily                  (roll-ups by day and model)
    AuditEvent                              (every change, by anyone; outlives what it names)
    PlatformSetting                         (key/value: the admin token's hash, secrets)

Shared by platform replicas on one database (``--shared-state database``)::

    Tenant ─< QuotaLease                    (one per admitted request of the last minute)
    AdminSession                            (admin UI sign-ins, by the SHA-256 of their id)
    PlatformEvent                           (a change feed every replica polls: released content)
    AdapterBlob                             (stored adapter files, chunked, by content hash)

The request log (search, export, retention)::

    Tenant ─┬─< RequestLogEntry             (one per API request, refused ones too)
            └── RequestLogSetting           (its opt-in to bodies, with a size cap)

Rows that a tenant owns are only ever queried through ``loraplex.platform.db.scope.TenantScope``.
Times are stored in UTC and read back timezone-aware, on SQLite as on PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

TenantStatus = Literal["active", "suspended"]
VersionStatus = Literal["validating", "ready", "failed"]

TENANT_STATUSES: tuple[str, ...] = ("active", "suspended")
VERSION_STATUSES: tuple[str, ...] = ("validating", "ready", "failed")

# Constraint names are explicit so that Alembic's batch mode can find them on SQLite.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timestamp stored in UTC and always returned timezone-aware (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if not isinstance(value, dt.datetime) or value.tzinfo is None:
            raise ValueError(f"timestamps must be timezone-aware datetimes, got {value!r}")
        return value.astimezone(dt.timezone.utc)

    def process_result_value(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        assert isinstance(value, dt.datetime)
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def _created() -> Mapped[dt.datetime]:
    return mapped_column(UTCDateTime(), default=utcnow)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)  # a slug; the public handle
    display_name: Mapped[str] = mapped_column(String(200), default="")
    status: Mapped[str] = mapped_column(String(16), default="active")  # TenantStatus
    # Quotas; None = unlimited.
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, default=None)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, default=None)
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer, default=None)
    max_adapters: Mapped[int | None] = mapped_column(Integer, default=None)
    # Scheduling: the tenant's share of the engine when backlogged (fair policy), and the most
    # urgent request priority it may ask for (lower runs earlier; 0 = no jumping the queue).
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default=text("1.0"))
    max_priority: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # Joins every prefix-cache key of this tenant's requests: tenants never share KV blocks.
    cache_salt: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = _created()
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)

    keys: Mapped[list[ApiKey]] = relationship(
        back_populates="tenant", cascade="all, delete-orphan", passive_deletes=True
    )
    adapters: Mapped[list[Adapter]] = relationship(
        back_populates="tenant", cascade="all, delete-orphan", passive_deletes=True
    )

    @property
    def active(self) -> bool:
        return self.status == "active"


class ApiKey(Base):
    """A tenant's key ``lpx_<public_id>_<secret>``: only the SHA-256 of the secret is stored."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100), default="")
    public_id: Mapped[str] = mapped_column(String(32), unique=True)
    secret_sha256: Mapped[str] = mapped_column(String(64))
    last4: Mapped[str] = mapped_column(String(4))
    scopes: Mapped[list[str]] = mapped_column(JSON, default=list)
    created_at: Mapped[dt.datetime] = _created()
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), default=None)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), default=None)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), default=None)
    # The models the key may use (base name, adapter name, "name@N"); None: every model of its
    # tenant (``loraplex.platform.model_access``).
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON, default=None)

    tenant: Mapped[Tenant] = relationship(back_populates="keys")

    def usable_at(self, now: dt.datetime) -> bool:
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or now < self.expires_at


class Adapter(Base):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_adapters_tenant_id_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    description: Mapped[str] = mapped_column(Text, default="")
    next_version: Mapped[int] = mapped_column(Integer, default=1)  # numbers are never reused
    created_at: Mapped[dt.datetime] = _created()
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)

    tenant: Mapped[Tenant] = relationship(back_populates="adapters")
    versions: Mapped[list[AdapterVersion]] = relationship(
        back_populates="adapter",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="AdapterVersion.number",
    )


class AdapterVersion(Base):
    """One immutable upload; the engine knows it by ``content_sha256`` (shared across tenants)."""

    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("adapter_id", "number", name="uq_adapter_versions_adapter_id_number"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(
        ForeignKey("adapters.id", ondelete="CASCADE"), index=True
    )
    number: Mapped[int] = mapped_column(Integer)
    content_sha256: Mapped[str] = mapped_column(String(64), index=True)
    rank: Mapped[int] = mapped_column(Integer, default=0)
    alpha: Mapped[float] = mapped_column(Float, default=0.0)
    target_modules: Mapped[list[str]] = mapped_column(JSON, default=list)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    storage_path: Mapped[str] = mapped_column(String(1024), default="")  # never leaves the server
    status: Mapped[str] = mapped_column(String(16), default="validating")  # VersionStatus
    error: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[dt.datetime] = _created()

    adapter: Mapped[Adapter] = relationship(back_populates="versions")


class UsageRecord(Base):
    """One request: what it cost and how it went (also when the client went away: status 499)."""

    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_records_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # None: the operator's own requests.
    tenant_id: Mapped[int | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), default=None
    )
    api_key_id: Mapped[int | None] = mapped_column(
        ForeignKey("api_keys.id", ondelete="SET NULL"), default=None
    )
    adapter_version_id: Mapped[int | None] = mapped_column(
        ForeignKey("adapter_versions.id", ondelete="SET NULL"), default=None
    )
    model: Mapped[str] = mapped_column(String(140))  # "base" name, or "adapter@N"
    request_id: Mapped[str] = mapped_column(String(64), default="")
    endpoint: Mapped[str] = mapped_column(String(64), default="")
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    latency_ms: Mapped[float] = mapped_column(Float, default=0.0)
    ttft_ms: Mapped[float | None] = mapped_column(Float, default=None)
    status: Mapped[int] = mapped_column(Integer)  # the HTTP status; 499 = client disconnected
    created_at: Mapped[dt.datetime] = _created()


class UsageDaily(Base):
    """Usage rolled up by tenant, UTC day and model; raw rows older than the retention go here."""

    __tablename__ = "usage_daily"
    __table_args__ = (
        UniqueConstraint("tenant_id", "day", "model", name="uq_usage_daily_tenant_id_day_model"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), default=None, index=True
    )
    day: Mapped[dt.date] = mapped_column(Date)
    model: Mapped[str] = mapped_column(String(140))
    requests: Mapped[int] = mapped_column(Integer, default=0)
    errors: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class AuditEvent(Base):
    """Who changed what: names are copied in, so the event outlives the rows it names."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(200))  # "admin", "tenant:acme/key:ab12cd34"
    tenant_name: Mapped[str | None] = mapped_column(String(64), default=None, index=True)
    action: Mapped[str] = mapped_column(String(64), index=True)  # "adapter.upload", "key.revoke"
    object_type: Mapped[str] = mapped_column(String(32))
    object_id: Mapped[str] = mapped_column(String(200))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    ip: Mapped[str | None] = mapped_column(String(64), default=None)


class PlatformSetting(Base):
    __tablename__ = "platform_settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


# An auto-incrementing 64-bit key (SQLite's rowid is 64-bit already; only INTEGER aliases it).
BigIntKey = BigInteger().with_variant(Integer(), "sqlite")


class QuotaLease(Base):
    """One admitted request in a tenant's quota window (``loraplex.platform.quota_db``).

    Times are epoch seconds of the admitting replica's clock. A lease is in flight while
    ``finished_at`` is None and ``expires_at`` is ahead: its replica pushes ``expires_at`` on
    while it lives (a heartbeat), so a dead replica's leases stop counting within the TTL.
    """

    __tablename__ = "quota_leases"
    __table_args__ = (
        Index("ix_quota_leases_tenant_id_admitted_at", "tenant_id", "admitted_at"),
        Index("ix_quota_leases_replica_id_finished_at", "replica_id", "finished_at"),
    )

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    replica_id: Mapped[str] = mapped_column(String(64))
    admitted_at: Mapped[float] = mapped_column(Float)
    estimated_tokens: Mapped[int] = mapped_column(BigInteger)
    actual_tokens: Mapped[int | None] = mapped_column(BigInteger, default=None)
    finished_at: Mapped[float | None] = mapped_column(Float, default=None)
    expires_at: Mapped[float] = mapped_column(Float)


class AdminSession(Base):
    """A signed-in admin UI session (``loraplex.webui.sessions.DatabaseSessionStore``): keyed
    by the SHA-256 of the cookie's id, never the id. Times are epoch seconds."""

    __tablename__ = "admin_sessions"
    __table_args__ = (Index("ix_admin_sessions_last_seen", "last_seen"),)

    id_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    csrf_token: Mapped[str] = mapped_column(String(64))
    credential_version: Mapped[str] = mapped_column(String(64))
    created: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)
    flashes: Mapped[list[list[str]]] = mapped_column(JSON, default=list)


class PlatformEvent(Base):
    """A change other replicas must act on, written in the transaction that made it (kind
    ``content.released``: no version names ``content_sha256`` any more)."""

    __tablename__ = "platform_events"

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True, autoincrement=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    kind: Mapped[str] = mapped_column(String(32))
    content_sha256: Mapped[str | None] = mapped_column(String(64), default=None)


class AdapterBlob(Base):
    """One chunk of one stored adapter file, so a replica without the uploader's disk can
    materialize ``adapters/<content_sha256>/`` (``loraplex.platform.registry.blobs``)."""

    __tablename__ = "adapter_blobs"

    content_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    file_name: Mapped[str] = mapped_column(String(64), primary_key=True)
    chunk: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Budget(Base):
    """A spending limit of a tenant, or of one of its keys (``api_key_id``), over a window
    (``loraplex.platform.budgets``): ``metric`` "tokens" counts ``prompt_weight`` x prompt +
    ``completion_weight`` x completion tokens, "cost" US dollars at ``ModelPrice``; ``period``
    day | week | month, ``anchor`` "calendar" (UTC) or "rolling". Charged from the usage rows."""

    __tablename__ = "budgets"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # None: the whole tenant; else one of its keys.
    api_key_id: Mapped[int | None] = mapped_column(
        ForeignKey("api_keys.id", ondelete="CASCADE"), default=None, index=True
    )
    metric: Mapped[str] = mapped_column(String(8))  # BudgetMetric
    period: Mapped[str] = mapped_column(String(8))  # BudgetPeriod
    anchor: Mapped[str] = mapped_column(String(8), default="calendar")  # BudgetAnchor
    limit_amount: Mapped[float] = mapped_column(Float)
    soft_percent: Mapped[float | None] = mapped_column(Float, default=None)
    prompt_weight: Mapped[float] = mapped_column(Float, default=1.0)
    completion_weight: Mapped[float] = mapped_column(Float, default=1.0)
    created_at: Mapped[dt.datetime] = _created()


class ModelPrice(Base):
    """The operator's price of a base model (by its served name) or of one adapter (any of its
    versions), in US dollars per million prompt / completion tokens; exactly one is set."""

    __tablename__ = "model_prices"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    base_model: Mapped[str | None] = mapped_column(String(140), default=None, unique=True)
    adapter_id: Mapped[int | None] = mapped_column(
        ForeignKey("adapters.id", ondelete="CASCADE"), default=None, unique=True
    )
    prompt_per_million: Mapped[float] = mapped_column(Float)
    completion_per_million: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class BudgetAlert(Base):
    """A budget's soft limit crossed or hard limit reached, once per budget, period and level:
    the unique key makes replicas that see the same crossing record it once."""

    __tablename__ = "budget_alerts"
    __table_args__ = (UniqueConstraint("budget_id", "period_start", "level"),)

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True, autoincrement=True)
    budget_id: Mapped[int] = mapped_column(ForeignKey("budgets.id", ondelete="CASCADE"))
    period_start: Mapped[float] = mapped_column(Float)  # epoch seconds
    level: Mapped[str] = mapped_column(String(8))  # "soft" | "hard"
    used: Mapped[float] = mapped_column(Float)
    created_at: Mapped[dt.datetime] = _created()


class RequestLogEntry(Base):
    """One API request, as the request log search shows it (``loraplex.platform.request_logs``):
    also the refused ones (4xx, 5xx), unlike ``UsageRecord``. Bodies only for a tenant that
    opted in (``RequestLogSetting``), cut at its cap. Kept ``request_log_retention_days``.

    Pages are ordered by ``id`` (keyset): rows are inserted with growing ids, so a new row never
    moves one already paged past."""

    __tablename__ = "request_logs"
    __table_args__ = (
        Index("ix_request_logs_tenant_id_id", "tenant_id", "id"),
        Index("ix_request_logs_key_id_id", "key_id", "id"),
        Index("ix_request_logs_served_model_id", "served_model", "id"),
        # A lookup by id is newest-first too: with (request_id, id) it reads one index entry
        # (PostgreSQL otherwise walks the primary key backwards for ``LIMIT 1``).
        Index("ix_request_logs_request_id_id", "request_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True, autoincrement=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), index=True)  # its arrival
    # None: the operator's own request.
    tenant_id: Mapped[int | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), default=None
    )
    key_id: Mapped[str | None] = mapped_column(String(32), default=None)  # the key's public id
    method: Mapped[str] = mapped_column(String(8))
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(140), default=None)  # as the caller sent it
    served_model: Mapped[str | None] = mapped_column(String(140), default=None)  # "name@N" | base
    status: Mapped[int] = mapped_column(Integer)
    error_code: Mapped[str | None] = mapped_column(String(64), default=None)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    ttft_ms: Mapped[float | None] = mapped_column(Float, default=None)
    duration_ms: Mapped[float] = mapped_column(Float)
    finish_reason: Mapped[str | None] = mapped_column(String(64), default=None)
    request_id: Mapped[str] = mapped_column(String(64))
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    request_body: Mapped[str | None] = mapped_column(Text, default=None)
    response_body: Mapped[str | None] = mapped_column(Text, default=None)


class RequestLogSetting(Base):
    """A tenant's opt-in to request and response bodies in its request log, cut at
    ``body_max_bytes`` each (no row: no bodies)."""

    __tablename__ = "request_log_settings"

    tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    body_max_bytes: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class Webhook(Base):
    """An operator's alert subscription (``loraplex.platform.webhooks``): events of the kinds
    in ``events`` are POSTed to ``url``, signed with ``secret`` (shown once, at creation)."""

    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    url: Mapped[str] = mapped_column(String(2000))
    events: Mapped[list[str]] = mapped_column(JSON, default=list)
    secret: Mapped[str] = mapped_column(String(100))  # never listed, never in the UI
    description: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[dt.datetime] = _created()


class WebhookEvent(Base):
    """One alert, once: ``event_id`` is derived from what happened (a budget's period, a key's
    expiry, ...), so replicas that see the same thing insert one row."""

    __tablename__ = "webhook_events"

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(String(40), unique=True)  # "evt_<hex>"
    kind: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)  # the delivered body, as JSON
    created_at: Mapped[dt.datetime] = _created()


class WebhookDelivery(Base):
    """One event to one subscription. A replica claims it (``claimed_until``, epoch seconds) by
    a conditional UPDATE before sending, so one replica sends each attempt; ``attempts`` counts
    the claims made."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("event_id", "webhook_id", name="uq_webhook_deliveries_event_id"),
        Index("ix_webhook_deliveries_state_next_attempt_at", "state", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True, autoincrement=True)
    event_id: Mapped[int] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"))
    webhook_id: Mapped[int] = mapped_column(
        ForeignKey("webhooks.id", ondelete="CASCADE"), index=True
    )
    state: Mapped[str] = mapped_column(String(16), default="pending")  # pending|succeeded|failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float] = mapped_column(Float)  # epoch seconds
    claimed_until: Mapped[float | None] = mapped_column(Float, default=None)
    claimed_by: Mapped[str | None] = mapped_column(String(64), default=None)
    last_status: Mapped[int | None] = mapped_column(Integer, default=None)  # receiver's HTTP
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    last_duration_ms: Mapped[float | None] = mapped_column(Float, default=None)
    created_at: Mapped[dt.datetime] = _created()
    last_attempt_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), default=None)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime(), default=None)
