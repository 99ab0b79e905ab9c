"""``WebhookService``: alerts in, signed deliveries out, off the request path.

    sources (event loop, never wait)        emit(Alert) -> a bounded in-memory queue
      BudgetManager.subscribe              budget.soft_limit_crossed / hard_limit_reached
      observe (request-log observer)       quota.exhausted: ``quota_refusals`` 429s of one
                                           tenant's per-minute quota in one ``quota_window_s``
      Registry.on_failure                  adapter.validation_failed / adapter.load_failed
    checks (the worker, every few seconds) engine.restarted (``engine_restarts`` went up),
                                           key.expiring (within ``key_expiry_hours``)
    worker (``run_forever``, one task)     queue -> rows (``store.record_event``, once per
                                           event id across replicas) -> claim due deliveries
                                           -> one task per attempt (``sender.post``, with its
                                           own deadline) -> outcome, retry after a backoff

Nothing a request does waits on the database or a receiver here: ``emit`` appends to a deque.
The queue holds at most ``MAX_QUEUED`` alerts (the oldest are dropped, with a warning) and at
most ``max_in_flight`` attempts run at once, so a hung receiver costs tasks, never requests.
Alert identity: each alert's ``dedup_key`` names what happened (a budget and its period; a
tenant and its window; a key and its expiry); its event id derives from it, so it is
recorded and delivered once however many replicas or checks see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.engine.client import EngineClient
from loraplex.platform.budget_manager import BudgetEvent
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import utcnow
from loraplex.platform.engine_state import EngineNotAnswering, read_engine_stats
from loraplex.platform.request_log import RequestRecord
from loraplex.platform.webhooks import sender, store
from loraplex.platform.webhooks.settings import WebhookSettings
from loraplex.platform.webhooks.signing import HEADER, sign

logger = logging.getLogger(__name__)

MAX_QUEUED = 10_000
ENGINE_POLL_S = 5.0
CLAIM_MARGIN_S = 30.0  # a claim outlives its attempt's deadline by this much
USER_AGENT = "loraplex-webhooks/1"
LOAD_FAILURES = ("adapter_failed", "adapter_load_failed")  # request errors: a failed load


@dataclass(frozen=True)
class Alert:
    """Something to tell subscribers of ``kind`` once (``dedup_key``: what happened)."""

    kind: str
    dedup_key: str
    data: dict[str, Any]
    tenant_id: int | None = None  # its name joins ``data`` when the alert is recorded


@dataclass
class QuotaRefusals:
    """Per-minute quota refusals by tenant, counted in fixed windows (this replica's)."""

    threshold: int
    window_s: float
    window: float = -math.inf
    counts: dict[int, int] = field(default_factory=dict)

    def refused(self, tenant_id: int, now: float) -> float | None:
        """Count one; the window's start when this one reaches the threshold, else None."""
        window = math.floor(now / self.window_s) * self.window_s
        if window != self.window:
            self.window, self.counts = window, {}
        count = self.counts.get(tenant_id, 0) + 1
        self.counts[tenant_id] = count
        return window if count == self.threshold else None


class WebhookService:
    """See the module docstring. ``clock``: epoch seconds (claims and retries)."""

    def __init__(
        self,
        db: Database,
        settings: WebhookSettings,
        *,
        replica: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self.settings = settings
        self.replica = replica or f"{socket.gethostname()[:40]}-{secrets.token_hex(4)}"
        self.clock = clock
        self.quota = QuotaRefusals(settings.quota_refusals, settings.quota_window_s)
        self._queue: deque[Alert] = deque()
        self._wake = asyncio.Event()
        self._sending: set[asyncio.Task[None]] = set()
        self._restarts: int | None = None  # the engine's, at the last look

    # ---- sources (never wait) ----------------------------------------------------------------

    def emit(self, alert: Alert) -> None:
        if len(self._queue) >= MAX_QUEUED:
            dropped = self._queue.popleft()
            logger.warning("webhooks: queue full, alert %s dropped", dropped.dedup_key)
        self._queue.append(alert)
        self._wake.set()

    def budget_alert(self, event: BudgetEvent) -> None:
        """``BudgetManager.subscribe`` listener (a crossing it recorded once)."""
        facts = event.facts
        key = f"{event.kind}:{facts.get('budget_id')}:{facts.get('window_start')}"
        self.emit(Alert(event.kind, key, {"tenant": event.tenant_name, **facts}))

    def adapter_failure(self, kind: str, facts: dict[str, Any], dedup_key: str) -> None:
        """``Registry.on_failure`` listener (a ``tenant_id`` fact becomes the tenant's name)."""
        data = dict(facts)
        tenant_id = data.pop("tenant_id", None)
        self.emit(Alert(kind, dedup_key, data, tenant_id if isinstance(tenant_id, int) else None))

    def observe(self, record: RequestRecord) -> None:
        """Request-log observer: per-minute quota refusals (429 ``rate_limit_exceeded``),
        counted; an adapter the engine failed to load for a request (``adapter_failed``,
        ``adapter_load_failed``), once per tenant, model and hour."""
        if record.tenant_id is None or not str(record.tenant_id).isdigit():
            return
        tenant_id = int(record.tenant_id)
        if record.error_code in LOAD_FAILURES:
            model = record.served_model or record.model or ""
            hour = int(self.clock() // 3600)
            data: dict[str, Any] = {"adapter": model, "code": record.error_code}
            data["request_id"] = record.request_id
            key = f"adapter.load_failed:{tenant_id}:{model}:{hour}"
            self.emit(Alert("adapter.load_failed", key, data, tenant_id))
            return
        if record.status != 429 or record.error_code != "rate_limit_exceeded":
            return
        window = self.quota.refused(tenant_id, self.clock())
        if window is None:
            return
        start = dt.datetime.fromtimestamp(window, dt.timezone.utc)
        data = {
            "refusals": self.quota.threshold,
            "window_start": start.isoformat(),
            "window_seconds": self.quota.window_s,
            "replica": self.replica,
        }
        self.emit(Alert("quota.exhausted", f"quota.exhausted:{tenant_id}:{window}", data,
                        tenant_id))  # fmt: skip

    # ---- checks (the worker) -----------------------------------------------------------------

    async def check_keys(self) -> int:
        """Queue a ``key.expiring`` alert for each key expiring soon; returns how many."""
        within = dt.timedelta(hours=self.settings.key_expiry_hours)
        found = await self.db.run(lambda s: store.expiring_keys(s, utcnow(), within))
        for tenant, key in found:
            assert key.expires_at is not None
            expires = key.expires_at.isoformat()
            data = {"tenant": tenant, "key": key.public_id, "name": key.name, "expires_at": expires}
            self.emit(Alert("key.expiring", f"key.expiring:{key.public_id}:{expires}", data))
        return len(found)

    async def purge(self) -> int:
        """Delete events older than ``retention_days`` with their deliveries."""
        before = utcnow() - dt.timedelta(days=self.settings.retention_days)
        purged: int = await self.db.run(lambda s: store.purge(s, before))
        return purged

    async def check_engine(self, client: EngineClient) -> bool:
        """Queue ``engine.restarted`` when this replica's engine restarted since the last
        look (the first look only notes the count); whether it did."""
        try:
            restarts = (await read_engine_stats(client, timeout=2.0)).engine_restarts
        except EngineNotAnswering:
            return False
        before, self._restarts = self._restarts, restarts
        if before is None or restarts <= before:
            return False
        data = {"replica": self.replica, "restarts": restarts}
        self.emit(Alert("engine.restarted", f"engine.restarted:{self.replica}:{restarts}", data))
        return True

    # ---- the worker --------------------------------------------------------------------------

    async def record_pending(self) -> int:
        """Write the queued alerts (each in its own transaction); returns how many were new."""
        new = 0
        while self._queue:
            alert = self._queue.popleft()
            now = self.clock()

            def write(session: Session, alert: Alert = alert, now: float = now) -> str | None:
                data = dict(alert.data)
                if alert.tenant_id is not None:
                    data["tenant"] = store.tenant_name(session, alert.tenant_id)
                return store.record_event(session, alert.kind, alert.dedup_key, data, now)

            try:
                new += (await self.db.run(write)) is not None
            except IntegrityError:  # another replica recorded it first
                continue
        return new

    async def send_due(self) -> int:
        """Claim the deliveries due (up to the free attempt slots) and start them."""
        free = self.settings.max_in_flight - len(self._sending)
        if free <= 0:
            return 0
        now, lease = self.clock(), self.settings.timeout_s + CLAIM_MARGIN_S
        claims = await self.db.run(lambda s: store.claim_due(s, self.replica, now, free, lease))
        for claim in claims:
            task = asyncio.get_running_loop().create_task(self._send(claim), name="webhook-send")
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        return len(claims)

    async def _send(self, claim: store.Claim) -> None:
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "X-Loraplex-Event-Id": claim.event_id,
            "X-Loraplex-Event-Type": claim.kind,
            "X-Loraplex-Delivery-Attempt": str(claim.attempt),
            HEADER: sign(claim.secret, claim.body, int(self.clock())),
        }
        outcome = await sender.post(claim.url, claim.body, headers, self.settings.timeout_s)
        settings, now = self.settings, self.clock()
        try:
            state = await self.db.run(
                lambda s: store.finish(
                    s, claim, status=outcome.status, error=outcome.error,
                    duration_ms=outcome.duration_ms, now=now,
                    max_attempts=settings.max_attempts, retry_base_s=settings.retry_base_s,
                )
            )  # fmt: skip
        except Exception:  # its claim lapses and the attempt is made again
            logger.exception("webhooks: recording delivery %s failed", claim.delivery_id)
            return
        if state == "pending":  # wake for its retry
            delay = settings.retry_base_s * 2 ** (claim.attempt - 1)
            asyncio.get_running_loop().call_later(delay, self._wake.set)
        elif state == "failed":
            logger.warning("webhooks: %s to %s failed %d times, last: %s", claim.event_id,
                           claim.url, claim.attempt, outcome.error)  # fmt: skip

    async def run_forever(self, client: EngineClient | None = None) -> None:
        """The worker: until cancelled. A failed round is logged and the next one retries."""
        next_keys = next_engine = -math.inf
        while True:
            self._wake.clear()
            try:
                now = time.monotonic()
                if now >= next_keys:
                    next_keys = now + self.settings.check_interval_s
                    await self.check_keys()
                    await self.purge()
                if client is not None and now >= next_engine:
                    next_engine = now + ENGINE_POLL_S
                    await self.check_engine(client)
                await self.record_pending()
                await self.send_due()
            except Exception:
                logger.exception("webhooks: a round of the worker failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)

    async def test_send(self, webhook_id: int) -> str:
        """Queue a ``webhook.test`` event to that one subscription; its event id."""
        now, nonce = self.clock(), secrets.token_hex(8)

        def write(session: Session) -> str:
            store.require_webhook(session, webhook_id)
            data = {"message": "A test delivery from loraplex.", "webhook_id": webhook_id}
            event_id = store.record_event(session, store.TEST_EVENT, f"webhook.test:{nonce}",
                                          data, now, only_webhook=webhook_id)  # fmt: skip
            assert event_id is not None  # a fresh nonce
            return event_id

        event_id = await self.db.run(write)
        self._wake.set()
        return event_id

    async def close(self) -> None:
        """Stop the attempts in flight (their claims lapse; another round sends them)."""
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)
