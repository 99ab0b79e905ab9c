"""Per-tenant quotas: requests per minute, tokens per minute, concurrent requests.

``QuotaManager.admit(caller, estimated_tokens)`` runs after authentication, model resolution and
tokenization, before the request reaches the engine. It answers a ``Lease``, or raises a 429
``rate_limit_exceeded`` (``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers). The lease is
released by ``lease.finish(actual_tokens)``, or, when the request was admitted with its
``RequestRecord``, by ``QuotaManager.observe`` (a request-log observer) when the response is done
or the client left, with the record's final token counts. ``finish`` is idempotent.

The limits, per tenant, over a sliding window of the last ``window`` (60) seconds:

* **requests/minute**: a request is admitted while fewer than ``limit`` requests were admitted in
  the window (a log of admission times; rejected requests are not counted, so a flood that is
  refused does not lengthen its own wait). Exact: never more than ``limit`` in any 60 seconds.
* **tokens/minute**: a request is admitted while the tenant's tokens in the window, counting the
  *actual* prompt + completion tokens of finished requests (charged when they finish) plus the
  *estimates* (prompt tokens + max_tokens) of requests still in flight, are below ``limit``. On
  finishing, the estimate is replaced by the actual count (never more). So the limit is exceeded
  by at most the last admitted request; a single request larger than the limit is admitted only
  into an empty window.
* **concurrent requests**: a counter of leases not yet finished.

Rejected requests change nothing. The operator (``tenant_id`` None) is never limited.

The state lives in this process: with several platform replicas each would enforce the limits
separately (a tenant would get up to ``replicas ×`` its limits); they would need a shared store
(Redis, or the database) to enforce one limit together.

Cost: admission is O(1) amortized (expired entries are popped from the left of the window
deques; each entry is pushed and popped once); computing ``Retry-After`` for a tokens/minute
refusal walks the tenant's finished requests of the last minute. The checks run without an
``await`` between test and update, so on the event loop they are atomic; the only lock is the
per-tenant one that makes a cold limits lookup hit the database once, not once per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from loraplex.platform.auth import Caller
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import Tenant
from loraplex.platform.errors import APIError, rate_limited
from loraplex.platform.request_log import RequestRecord

logger = logging.getLogger(__name__)

WINDOW_S = 60.0
LIMITS_TTL_S = 2.0  # a quota change takes effect within this (at once through the admin API)


@dataclass(frozen=True)
class Limits:
    """A tenant's limits; None = unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    tenant_name: str = ""

    @classmethod
    def of(cls, tenant: Tenant) -> Limits:
        return cls(
            tenant.requests_per_minute,
            tenant.tokens_per_minute,
            tenant.max_concurrent_requests,
            tenant.name,
        )


@dataclass
class _TenantState:
    """The window of one tenant. Invariants: ``requests`` and ``tokens`` are ordered by time;
    ``tokens_in_window == sum(n for _, n in tokens)``; ``reserved`` is the sum of the estimates
    of unfinished leases, ``in_flight`` their number."""

    limits: Limits = Limits()
    limits_until: float = -math.inf
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    tokens_in_window: int = 0
    reserved: int = 0
    in_flight: int = 0

    def expire(self, now: float, window: float) -> None:
        horizon = now - window
        requests = self.requests
        while requests and requests[0] <= horizon:
            requests.popleft()
        tokens = self.tokens
        while tokens and tokens[0][0] <= horizon:
            self.tokens_in_window -= tokens.popleft()[1]


class Lease:
    """An admitted request's hold on its tenant's quotas, until ``finish``."""

    def __init__(
        self,
        manager: QuotaManager | None,
        state: _TenantState | None,
        estimated_tokens: int,
        headers: dict[str, str],
    ) -> None:
        self._manager = manager
        self._state = state
        self.estimated_tokens = estimated_tokens
        self.headers = headers  # x-ratelimit-* at admission; may go on the response
        self.finished = False

    def finish(self, actual_tokens: int) -> None:
        """Release the concurrency slot and charge ``actual_tokens`` (prompt + completion)
        instead of the estimate. Idempotent."""
        if self.finished:
            return
        self.finished = True
        if self._manager is not None and self._state is not None:
            self._manager._release(self._state, self.estimated_tokens, max(0, actual_tokens))

    def finish_record(self, record: RequestRecord) -> None:
        self.finish(record.prompt_tokens + record.completion_tokens)


class QuotaManager:
    """Admission control for every tenant of one platform process (see the module docstring).

    ``db``: where tenants' limits are read (None: only ``limits=`` given to ``admit``).
    ``clock``: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        db: Database | None,
        *,
        window: float = WINDOW_S,
        limits_ttl: float = LIMITS_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.window = window
        self.limits_ttl = limits_ttl
        self.clock = clock
        self._tenants: dict[int, _TenantState] = {}
        self._by_record: dict[int, Lease] = {}  # id(RequestRecord) -> its lease, while open

    # ---- limits ------------------------------------------------------------------------------

    def _state(self, tenant_id: int) -> _TenantState:
        state = self._tenants.get(tenant_id)
        if state is None:
            state = self._tenants[tenant_id] = _TenantState()
        return state

    async def limits(self, tenant_id: int) -> Limits:
        """The tenant's limits, read from its row at most every ``limits_ttl`` seconds."""
        state = self._state(tenant_id)
        if self.clock() < state.limits_until or self.db is None:
            return state.limits
        async with state.lock:  # one lookup per tenant, however many requests wait for it
            if self.clock() >= state.limits_until:

                def load(session: Session) -> Limits:
                    tenant = session.get(Tenant, tenant_id)
                    return Limits.of(tenant) if tenant is not None else Limits()

                state.limits = await self.db.run(load)
                state.limits_until = self.clock() + self.limits_ttl
        return state.limits

    def invalidate(self, tenant_id: int) -> None:
        """Read the tenant's limits again on its next request (after a quota change)."""
        state = self._tenants.get(tenant_id)
        if state is not None:
            state.limits_until = -math.inf

    def forget(self, tenant_id: int) -> None:
        """Drop a deleted tenant's state (its open leases release into the dropped state)."""
        self._tenants.pop(tenant_id, None)

    # ---- admission ---------------------------------------------------------------------------

    async def admit(
        self,
        caller: Caller,
        estimated_tokens: int,
        *,
        record: RequestRecord | None = None,
        limits: Limits | None = None,
    ) -> Lease:
        """Admit one request of ``caller`` expected to use ``estimated_tokens`` (prompt tokens +
        max_tokens for every sample), or raise ``APIError`` 429. With ``record``, ``observe``
        finishes the lease when the request ends; otherwise call ``lease.finish``."""
        if caller.tenant_id is None:
            return Lease(None, None, 0, {})  # the operator: no limits, nothing to release
        tenant_id = int(caller.tenant_id)
        if limits is None:
            limits = await self.limits(tenant_id)
        # No await from here on: the test and the update below are atomic on the event loop.
        state = self._state(tenant_id)
        now = self.clock()
        state.expire(now, self.window)
        estimate = max(0, int(estimated_tokens))
        self._check(state, limits, now)
        state.requests.append(now)
        state.reserved += estimate
        state.in_flight += 1
        lease = Lease(self, state, estimate, self._headers(state, limits, now))
        if record is not None:
            self._by_record[id(record)] = lease
        return lease

    def observe(self, record: RequestRecord) -> None:
        """Request-log observer: finish the lease ``admit`` took for ``record``, if any."""
        lease = self._by_record.pop(id(record), None)
        if lease is not None:
            lease.finish_record(record)

    def in_flight(self, tenant_id: int) -> int:
        state = self._tenants.get(tenant_id)
        return state.in_flight if state is not None else 0

    def _release(self, state: _TenantState, estimate: int, actual: int) -> None:
        now = self.clock()
        state.in_flight -= 1
        state.reserved -= estimate
        if actual:
            state.tokens.append((now, actual))
            state.tokens_in_window += actual
        state.expire(now, self.window)

    def _check(self, state: _TenantState, limits: Limits, now: float) -> None:
        who = f"Tenant {limits.tenant_name!r}" if limits.tenant_name else "This tenant"
        cap = limits.max_concurrent_requests
        if cap is not None and state.in_flight >= cap:
            raise self._refuse(
                state, limits, now, 1, "requests",
                f"{who} already has {state.in_flight} requests in progress, its limit of "
                f"concurrent requests ({cap}); retry when one finishes, or ask the operator to "
                "raise max_concurrent_requests.",
            )  # fmt: skip
        rpm = limits.requests_per_minute
        if rpm is not None and len(state.requests) >= rpm:
            # The request that must leave the window for one more to fit.
            wait = state.requests[-rpm] + self.window - now if rpm > 0 else self.window
            retry = _ceil_s(wait)
            raise self._refuse(
                state, limits, now, retry, "requests",
                f"{who} reached its limit of {rpm} requests per minute; retry in {retry} s "
                "(Retry-After), or ask the operator to raise requests_per_minute.",
            )  # fmt: skip
        tpm = limits.tokens_per_minute
        if tpm is not None and state.tokens_in_window + state.reserved >= tpm:
            retry = self._tokens_retry(state, tpm, now)
            raise self._refuse(
                state, limits, now, retry, "tokens",
                f"{who} reached its limit of {tpm} tokens per minute (used "
                f"{state.tokens_in_window}, {state.reserved} held by requests in progress); "
                f"retry in {retry} s (Retry-After), send a smaller max_tokens, or ask the "
                "operator to raise tokens_per_minute.",
            )  # fmt: skip

    def _tokens_retry(self, state: _TenantState, tpm: int, now: float) -> int:
        """Seconds until enough finished requests leave the window for one more request (an
        upper bound: requests in progress only ever give tokens back). When the estimates of
        requests in progress fill the limit alone, 1: they free it as they finish."""
        excess = state.tokens_in_window + state.reserved - tpm  # >= 0: must drop below 0
        if state.reserved >= tpm:
            return 1
        freed = 0
        for at, n in state.tokens:
            freed += n
            if freed > excess:
                return _ceil_s(at + self.window - now)
        return _ceil_s(self.window)  # unreachable: every finished entry expires in time

    def _refuse(
        self, state: _TenantState, limits: Limits, now: float, retry: int, kind: str, msg: str
    ) -> APIError:
        error = rate_limited(msg, retry, kind)
        error.headers = {**(error.headers or {}), **self._headers(state, limits, now)}
        return error

    def _headers(self, state: _TenantState, limits: Limits, now: float) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` for the limits the tenant has. ``reset``: the time until
        the window is back to its initial state (the newest entry leaves it)."""
        headers: dict[str, str] = {}
        rpm = limits.requests_per_minute
        if rpm is not None:
            reset = state.requests[-1] + self.window - now if state.requests else 0.0
            headers["x-ratelimit-limit-requests"] = str(rpm)
            headers["x-ratelimit-remaining-requests"] = str(max(0, rpm - len(state.requests)))
            headers["x-ratelimit-reset-requests"] = format_duration(reset)
        tpm = limits.tokens_per_minute
        if tpm is not None:
            used = state.tokens_in_window + state.reserved
            reset = state.tokens[-1][0] + self.window - now if state.tokens else 0.0
            headers["x-ratelimit-limit-tokens"] = str(tpm)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, tpm - used))
            headers["x-ratelimit-reset-tokens"] = format_duration(reset)
        return headers


def _ceil_s(seconds: float) -> int:
    return max(1, math.ceil(seconds - 1e-9))


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: ``"0s"``, ``"250ms"``, ``"6s"``, ``"1m30s"``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    whole = math.ceil(seconds - 1e-9)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def estimate_tokens(
    prompts: list[list[int]], n: int, max_tokens: int | None, max_model_len: int
) -> int:
    """The admission estimate of a request, an upper bound of what it will be charged: each
    prompt's tokens (counted once, as usage counts them) plus, for each of its ``n`` samples,
    ``max_tokens`` (None: until the context is full)."""
    total = 0
    for prompt in prompts:
        room = max(0, max_model_len - len(prompt))
        total += len(prompt) + n * (room if max_tokens is None else min(max_tokens, room))
    return total
