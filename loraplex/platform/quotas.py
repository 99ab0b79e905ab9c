"""Per-tenant quotas: requests per minute, tokens per minute, concurrent requests.

``QuotaManager.admit(caller, estimated_tokens)`` runs after authentication and model resolution
(which has no side effects), before anything that costs: tokenization, constraint compilation,
adapter loads, the engine. It answers a ``Lease``, or raises a 429 ``rate_limit_exceeded``
(``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers). Since the prompt is not tokenized yet,
the estimate is an upper bound computed without tokenizing (``estimate_bound``); once the
prompt is tokenized, ``lease.narrow(estimate_tokens(...))`` lowers the reservation to the exact
estimate. The lease is released by ``lease.finish(actual_tokens)``, or, when the request was
admitted with its ``RequestRecord``, by ``QuotaManager.observe`` (a request-log observer) when
the response is done or the client left, with the record's final token counts. ``finish`` is
idempotent.

The limits, per tenant, over a sliding window of the last ``window`` (60) seconds:

* **requests/minute**: a request is admitted while fewer than ``limit`` requests were admitted in
  the window (a log of admission times; rejected requests are not counted, so a flood that is
  refused does not lengthen its own wait). Exact: never more than ``limit`` in any 60 seconds.
* **tokens/minute**: a request is admitted while the tenant's tokens in the window, counting the
  *actual* prompt + completion tokens of finished requests (charged when they finish) plus the
  *estimates* (prompt tokens + max_tokens) of requests still in flight, are below ``limit``. On
  finishing, the estimate is replaced by the actual count. So the limit is exceeded by at most
  the last admitted request; a single request larger than the limit is admitted only into an
  empty window.
* **concurrent requests**: the number of leases not yet finished.

Rejected requests change nothing. The operator (``tenant_id`` None) is never limited.

Where the state lives is a ``QuotaStore``: ``MemoryQuotaStore`` (this process; the default of a
single server on SQLite) or ``loraplex.platform.quota_db.DatabaseQuotaStore`` (a table every
platform replica on one database shares, so a tenant's limits hold across all of them). Both
compute a ``Window`` and leave the decision and the headers to ``refusal`` and ``rate_headers``
here, so the two enforce the same rules, word for word.

Memory cost: admission is O(1) amortized (expired entries are popped from the left of the window
deques; each entry is pushed and popped once); computing ``Retry-After`` for a tokens/minute
refusal walks the tenant's finished requests of the last minute. The memory store's checks run
without an ``await`` between test and update, so on the event loop they are atomic; the only lock
is the per-tenant one that makes a cold limits lookup hit the database once, not once per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from sqlalchemy.orm import Session

from loraplex.platform.auth import Caller
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import Tenant
from loraplex.platform.errors import APIError, rate_limited
from loraplex.platform.request_log import RequestRecord

if TYPE_CHECKING:
    from loraplex.platform.budget_manager import BudgetManager

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

    @property
    def unlimited(self) -> bool:
        return (
            self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.max_concurrent_requests is None
        )


# ---- the rules, on a snapshot of one tenant's window ------------------------------------------


@dataclass(frozen=True)
class Window:
    """One tenant's quota state at ``now``, as the rules read it (any store builds one).

    ``rpm_edge``: the admission time of the ``requests_per_minute``-th newest admission in the
    window (the one that must leave it for one more to fit); None when there are fewer.
    ``finished``: (finished at, tokens > 0) of the requests finished in the window, oldest
    first; called only to compute a tokens/minute refusal's ``Retry-After``.
    """

    requests: int  # admissions in the window
    rpm_edge: float | None
    newest_request: float | None
    tokens_used: int  # actual tokens of the requests finished in the window
    newest_tokens: float | None  # when the newest of those finished
    reserved: int  # estimates of the requests in flight
    in_flight: int
    finished: Callable[[], Iterable[tuple[float, int]]]

    def admitting(self, now: float, estimate: int) -> Window:
        """The window once a request of ``estimate`` tokens is admitted at ``now``."""
        return replace(
            self,
            requests=self.requests + 1,
            newest_request=now,
            reserved=self.reserved + estimate,
            in_flight=self.in_flight + 1,
        )


def refusal(window: Window, limits: Limits, now: float, span: float) -> APIError | None:
    """The 429 that ``limits`` give a new request on ``window`` at ``now``; None: admit it."""
    who = f"Tenant {limits.tenant_name!r}" if limits.tenant_name else "This tenant"
    cap = limits.max_concurrent_requests
    if cap is not None and window.in_flight >= cap:
        return _refuse(
            window, limits, now, span, 1, "requests",
            f"{who} already has {window.in_flight} requests in progress, its limit of "
            f"concurrent requests ({cap}); retry when one finishes, or ask the operator to "
            "raise max_concurrent_requests.",
        )  # fmt: skip
    rpm = limits.requests_per_minute
    if rpm is not None and window.requests >= rpm:
        edge = window.rpm_edge
        wait = edge + span - now if rpm > 0 and edge is not None else span
        # never past the window: another replica's admission (or clock) can be a little ahead
        retry = _ceil_s(min(wait, span))
        return _refuse(
            window, limits, now, span, retry, "requests",
            f"{who} reached its limit of {rpm} requests per minute; retry in {retry} s "
            "(Retry-After), or ask the operator to raise requests_per_minute.",
        )  # fmt: skip
    tpm = limits.tokens_per_minute
    if tpm is not None and window.tokens_used + window.reserved >= tpm:
        retry = _tokens_retry(window, tpm, now, span)
        return _refuse(
            window, limits, now, span, retry, "tokens",
            f"{who} reached its limit of {tpm} tokens per minute (used "
            f"{window.tokens_used}, {window.reserved} held by requests in progress); "
            f"retry in {retry} s (Retry-After), send a smaller max_tokens, or ask the "
            "operator to raise tokens_per_minute.",
        )  # fmt: skip
    return None


def _tokens_retry(window: Window, tpm: int, now: float, span: float) -> int:
    """Seconds until enough finished requests leave the window for one more request (an upper
    bound: requests in progress only ever give tokens back). When the estimates of requests in
    progress fill the limit alone, 1: they free it as they finish."""
    excess = window.tokens_used + window.reserved - tpm  # >= 0: must drop below 0
    if window.reserved >= tpm:
        return 1
    freed = 0
    for at, n in window.finished():
        freed += n
        if freed > excess:
            return _ceil_s(min(at + span - now, span))
    return _ceil_s(span)  # unreachable: every finished entry expires in time


def _refuse(
    window: Window, limits: Limits, now: float, span: float, retry: int, kind: str, msg: str
) -> APIError:
    error = rate_limited(msg, retry, kind)
    error.headers = {**(error.headers or {}), **rate_headers(window, limits, now, span)}
    return error


def rate_headers(window: Window, limits: Limits, now: float, span: float) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` for the limits the tenant has. ``reset``: the time until the
    window is back to its initial state (the newest entry leaves it)."""
    headers: dict[str, str] = {}
    rpm = limits.requests_per_minute
    if rpm is not None:
        newest = window.newest_request
        reset = newest + span - now if newest is not None else 0.0
        headers["x-ratelimit-limit-requests"] = str(rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, rpm - window.requests))
        headers["x-ratelimit-reset-requests"] = format_duration(reset)
    tpm = limits.tokens_per_minute
    if tpm is not None:
        used = window.tokens_used + window.reserved
        newest = window.newest_tokens
        reset = newest + span - now if newest is not None else 0.0
        headers["x-ratelimit-limit-tokens"] = str(tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, tpm - used))
        headers["x-ratelimit-reset-tokens"] = format_duration(reset)
    return headers


# ---- where the state lives ---------------------------------------------------------------------


class QuotaStore(Protocol):
    """The admission state of every tenant. ``admit`` raises the 429 of ``refusal`` or takes
    the request (atomically with its check) and returns a handle and the ``x-ratelimit-*``
    headers; ``release`` is called once per handle (from the event loop, without waiting)."""

    async def admit(
        self, tenant_id: int, limits: Limits, estimate: int
    ) -> tuple[object, dict[str, str]]: ...

    def release(self, handle: object, actual_tokens: int) -> None: ...

    def narrow(self, handle: object, estimate: int) -> None:
        """Lower an unreleased handle's reservation to ``estimate`` (never raises it; from the
        event loop, without waiting)."""
        ...

    def in_flight(self, tenant_id: int) -> int:
        """This process's leases of the tenant not yet finished."""
        ...

    def forget(self, tenant_id: int) -> None: ...

    async def maintain_forever(self) -> None:
        """What the store does in the background while serving (returns when nothing)."""
        ...

    async def close(self) -> None:
        """Finish what ``release`` started (shutdown; tests)."""
        ...


@dataclass
class _TenantState:
    """The window of one tenant. Invariants: ``requests`` and ``tokens`` are ordered by time;
    ``tokens_in_window == sum(n for _, n in tokens)``; ``reserved`` is the sum of the estimates
    of unfinished leases, ``in_flight`` their number."""

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

    def view(self, rpm: int | None) -> Window:
        requests = self.requests
        edge = requests[-rpm] if rpm and len(requests) >= rpm else None
        return Window(
            requests=len(requests),
            rpm_edge=edge,
            newest_request=requests[-1] if requests else None,
            tokens_used=self.tokens_in_window,
            newest_tokens=self.tokens[-1][0] if self.tokens else None,
            reserved=self.reserved,
            in_flight=self.in_flight,
            finished=lambda: self.tokens,
        )


@dataclass
class _MemoryHandle:
    state: _TenantState
    estimate: int  # what it holds in ``state.reserved`` now


class MemoryQuotaStore:
    """Quota state in this process's memory: exact for one server; with several platform
    replicas each would enforce the limits alone (use ``DatabaseQuotaStore`` there).

    ``clock``: monotonic seconds (tests pass a fake one)."""

    def __init__(
        self, *, window: float = WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window
        self.clock = clock
        self._tenants: dict[int, _TenantState] = {}

    def _state(self, tenant_id: int) -> _TenantState:
        state = self._tenants.get(tenant_id)
        if state is None:
            state = self._tenants[tenant_id] = _TenantState()
        return state

    async def admit(
        self, tenant_id: int, limits: Limits, estimate: int
    ) -> tuple[object, dict[str, str]]:
        # No await in here: the test and the update below are atomic on the event loop.
        state = self._state(tenant_id)
        now = self.clock()
        state.expire(now, self.window)
        error = refusal(state.view(limits.requests_per_minute), limits, now, self.window)
        if error is not None:
            raise error
        state.requests.append(now)
        state.reserved += estimate
        state.in_flight += 1
        headers = rate_headers(state.view(None), limits, now, self.window)
        return _MemoryHandle(state, estimate), headers

    def release(self, handle: object, actual_tokens: int) -> None:
        assert isinstance(handle, _MemoryHandle)
        state, now = handle.state, self.clock()
        state.in_flight -= 1
        state.reserved -= handle.estimate
        if actual_tokens:
            state.tokens.append((now, actual_tokens))
            state.tokens_in_window += actual_tokens
        state.expire(now, self.window)

    def narrow(self, handle: object, estimate: int) -> None:
        assert isinstance(handle, _MemoryHandle)
        lower = min(handle.estimate, estimate)
        handle.state.reserved -= handle.estimate - lower
        handle.estimate = lower

    def in_flight(self, tenant_id: int) -> int:
        state = self._tenants.get(tenant_id)
        return state.in_flight if state is not None else 0

    def forget(self, tenant_id: int) -> None:
        """Drop a deleted tenant's state (its open leases release into the dropped state)."""
        self._tenants.pop(tenant_id, None)

    async def maintain_forever(self) -> None:
        return None

    async def close(self) -> None:
        return None


# ---- the manager ---------------------------------------------------------------------------------


class Lease:
    """An admitted request's hold on its tenant's quotas, until ``finish``."""

    def __init__(
        self,
        store: QuotaStore | None,
        handle: object,
        estimated_tokens: int,
        headers: dict[str, str],
    ) -> None:
        self._store = store
        self._handle = handle
        self.estimated_tokens = estimated_tokens
        self.headers = headers  # x-ratelimit-* at admission; may go on the response
        self.finished = False

    def narrow(self, estimated_tokens: int) -> None:
        """Lower the reservation to ``estimated_tokens`` (the exact estimate, once the prompt
        is tokenized); a higher figure changes nothing: the admission bound holds."""
        estimate = max(0, int(estimated_tokens))
        if self.finished or estimate >= self.estimated_tokens:
            return
        self.estimated_tokens = estimate
        if self._store is not None:
            self._store.narrow(self._handle, estimate)

    def finish(self, actual_tokens: int) -> None:
        """Release the concurrency slot and charge ``actual_tokens`` (prompt + completion)
        instead of the estimate. Idempotent."""
        if self.finished:
            return
        self.finished = True
        if self._store is not None:
            self._store.release(self._handle, max(0, actual_tokens))

    def finish_record(self, record: RequestRecord) -> None:
        self.finish(record.prompt_tokens + record.completion_tokens)


@dataclass
class _LimitsEntry:
    limits: Limits = Limits()
    until: float = -math.inf
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class QuotaManager:
    """Admission control for every tenant (see the module docstring).

    ``db``: where tenants' limits are read (None: only ``limits=`` given to ``admit``).
    ``store``: where the windows live (default: ``MemoryQuotaStore`` on ``clock``).
    ``clock``: monotonic seconds for the limits cache and the default store (tests fake it).
    ``budgets``: checked with the quotas for requests admitted with their record (the
    completions), before the quotas take anything (None: no budgets).
    """

    def __init__(
        self,
        db: Database | None,
        *,
        store: QuotaStore | None = None,
        budgets: BudgetManager | None = None,
        window: float = WINDOW_S,
        limits_ttl: float = LIMITS_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.window = window
        self.limits_ttl = limits_ttl
        self.clock = clock
        self.store: QuotaStore = store or MemoryQuotaStore(window=window, clock=clock)
        self.budgets = budgets
        self._limits: dict[int, _LimitsEntry] = {}
        self._by_record: dict[int, Lease] = {}  # id(RequestRecord) -> its lease, while open

    # ---- limits ------------------------------------------------------------------------------

    async def limits(self, tenant_id: int) -> Limits:
        """The tenant's limits, read from its row at most every ``limits_ttl`` seconds."""
        entry = self._limits.get(tenant_id)
        if entry is None:
            entry = self._limits[tenant_id] = _LimitsEntry()
        if self.clock() < entry.until or self.db is None:
            return entry.limits
        async with entry.lock:  # one lookup per tenant, however many requests wait for it
            if self.clock() >= entry.until:

                def load(session: Session) -> Limits:
                    tenant = session.get(Tenant, tenant_id)
                    return Limits.of(tenant) if tenant is not None else Limits()

                entry.limits = await self.db.run(load)
                entry.until = self.clock() + self.limits_ttl
        return entry.limits

    def invalidate(self, tenant_id: int) -> None:
        """Read the tenant's limits again on its next request (after a quota change)."""
        entry = self._limits.get(tenant_id)
        if entry is not None:
            entry.until = -math.inf

    def forget(self, tenant_id: int) -> None:
        """Drop a deleted tenant's state."""
        self._limits.pop(tenant_id, None)
        self.store.forget(tenant_id)

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
        estimate = max(0, int(estimated_tokens))
        budget = None
        if record is not None and self.budgets is not None:
            budget = await self.budgets.check(caller)  # 429 budget_exceeded; takes nothing
        handle, headers = await self.store.admit(tenant_id, limits, estimate)
        if budget is not None and self.budgets is not None:
            headers = {**headers, **budget.headers}
            self.budgets.track(record, budget)  # type: ignore[arg-type]  # record is set
        lease = Lease(self.store, handle, estimate, headers)
        if record is not None:
            self._by_record[id(record)] = lease
        return lease

    def observe(self, record: RequestRecord) -> None:
        """Request-log observer: finish the lease ``admit`` took for ``record``, if any."""
        lease = self._by_record.pop(id(record), None)
        if lease is not None:
            lease.finish_record(record)

    def in_flight(self, tenant_id: int) -> int:
        return self.store.in_flight(tenant_id)


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


# Admission comes before tokenization, so its estimate cannot count the prompt's tokens. What
# bounds them, cheaply:
#   * a prompt of token ids: its length (exact);
#   * a text: its UTF-8 bytes plus the special tokens the tokenizer adds plus one (a leading
#     "dummy prefix" token): a byte-level BPE token covers at least one byte, a byte-fallback or
#     character-level token one character (at least one byte), an unknown-word token one word;
#   * any prompt that reaches the engine: ``max_model_len`` - 1 (a longer one is refused with a
#     400 before the engine, and is charged nothing), so a chat prompt, whose template adds
#     text that only rendering tells, is bounded by the context.
# The bound holds only until the prompt is tokenized (milliseconds; a second for a megabyte):
# ``Lease.narrow`` then lowers it to ``estimate_tokens``. Admitting with 0 tokens and adding
# the estimate afterwards was the other choice: it lets a burst of concurrent requests all pass
# the tokens/minute check before any of them reserves, breaking "over by at most the last
# admitted request"; an over-reservation for milliseconds only refuses early, and only a tenant
# already near its limit.


def text_token_bound(text: str, special_tokens: int) -> int:
    """At most how many tokens ``text`` tokenizes to (see above), without tokenizing it."""
    return len(text.encode("utf-8")) + special_tokens + 1


def estimate_bound(
    prompt_bounds: list[int], n: int, max_tokens: int | None, max_model_len: int
) -> int:
    """An upper bound of ``estimate_tokens`` for prompts of at most ``prompt_bounds[i]``
    tokens each (and at most ``max_model_len`` - 1, see above): the largest estimate over every
    prompt length the bound allows."""
    total = 0
    limit = max_model_len
    for bound in prompt_bounds:
        most = max(0, min(bound, limit - 1))
        # f(p) = p + n * min(m, L - p) grows with p up to p = L - m and falls (n > 1) or
        # stays (n = 1) beyond: its largest value on [0, most] is at min(most, L - m).
        m = limit if max_tokens is None else max(0, max_tokens)
        p = min(most, max(0, limit - m))
        total += p + n * min(m, limit - p)
    return total
