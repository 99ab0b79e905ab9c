"""``BudgetManager``: budgets at admission, charged from the usage rows, and their crossings.

Admission (``check``, called by ``QuotaManager.admit`` with the quota check, before anything
that costs) reads, in one transaction, what each budget of the caller's tenant and key has used
(``budget_store.statuses``); any budget at or over its limit refuses the request with 429
``budget_exceeded`` (the budget, what it used, when it resets, ``Retry-After``). An admitted
request gets ``x-ratelimit-*-budget-*`` headers with what is left before it.

Charging: the request's usage row *is* its charge. A budgeted request's row is written at once
when the request ends (``observe``, a request-log observer after the usage recorder's: it
flushes the recorder's buffer in a task), and this replica's next admission of the tenant
waits for that write, so a replica never admits past its own finished requests. Another
replica sees the row once it commits (milliseconds after the response), as it sees quota
releases (``quota_db``). Nothing is reserved for requests in flight: they finish and are
charged in full, so a budget is exceeded by at most the tokens of the requests in flight when
it was reached.

Crossings: after a budgeted request's row is written, the budgets it touched are read again
when its own tokens may have taken one over a threshold not yet recorded (``_may_cross``);
a soft limit crossed or a hard limit reached is recorded once per budget and period
(``BudgetAlert``, unique across replicas) with an audit event (``budget.soft_limit_crossed``,
``budget.hard_limit_reached``), and each listener (``subscribe``) gets a ``BudgetEvent`` on the
replica that recorded it. Listeners run on the event loop and must not block (an alert sender
queues its delivery).

The budgets that apply to a caller are read at most every ``rules_ttl`` seconds per tenant and
key (``invalidate`` on a change through this replica: at once).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.platform import budget_store as store
from loraplex.platform.auth import Caller
from loraplex.platform.budget_store import Applicable
from loraplex.platform.budgets import (
    BudgetRule,
    BudgetStatus,
    Prices,
    alert_period,
    budget_headers,
    refusal,
)
from loraplex.platform.db.database import Database
from loraplex.platform.db.models import Tenant, utcnow
from loraplex.platform.request_log import RequestRecord
from loraplex.platform.usage import UsageRecorder

logger = logging.getLogger(__name__)

RULES_TTL_S = 2.0
MAX_REMEMBERED = 10_000  # crossings known recorded (beyond: forgotten, read again)


@dataclass(frozen=True)
class BudgetEvent:
    """A soft limit crossed (``budget.soft_limit_crossed``) or a hard limit reached
    (``budget.hard_limit_reached``); ``facts``: ``budget_store.alert_facts``."""

    kind: str
    tenant_name: str
    facts: dict[str, Any]


BudgetListener = Callable[[BudgetEvent], None]


@dataclass(frozen=True)
class BudgetAdmission:
    """A request admitted under budgets: which, their state before it, and its headers."""

    tenant_id: int
    applicable: Applicable
    states: tuple[BudgetStatus, ...]
    headers: dict[str, str]


@dataclass
class _Entry:
    applicable: Applicable = field(default_factory=lambda: Applicable("", (), Prices()))
    until: float = -math.inf
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class BudgetManager:
    """See the module docstring. ``base_name``: the served base model's name (its price is an
    unpriced adapter's); ``now``: UTC wall-clock time (tests fake it); ``clock``: monotonic
    seconds for the rules cache."""

    def __init__(
        self,
        db: Database,
        usage: UsageRecorder,
        base_name: Callable[[], str],
        *,
        rules_ttl: float = RULES_TTL_S,
        now: Callable[[], dt.datetime] = utcnow,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.usage = usage
        self.base_name = base_name
        self.rules_ttl = rules_ttl
        self.now = now
        self.clock = clock
        self._rules: dict[tuple[int, str | None], _Entry] = {}
        self._by_record: dict[int, BudgetAdmission] = {}  # id(RequestRecord) -> while open
        self._writes: dict[int, set[asyncio.Task[int]]] = {}  # tenant id -> row flushes
        self._checks: set[asyncio.Task[None]] = set()  # crossing checks still running
        self._listeners: list[BudgetListener] = []
        self.settled = store.SettledDays()  # settled days' usage, per tenant / key
        self._recorded: set[tuple[int, float, str]] = set()  # (budget, period, level) known

    # ---- which budgets apply ---------------------------------------------------------------

    async def applicable(self, tenant_id: int, key_public_id: str | None) -> Applicable:
        entry = self._rules.setdefault((tenant_id, key_public_id), _Entry())
        if self.clock() < entry.until:
            return entry.applicable
        async with entry.lock:  # one lookup per tenant and key, however many requests wait
            if self.clock() >= entry.until:
                entry.applicable = await self.db.run(
                    lambda s: store.applicable(s, tenant_id, key_public_id)
                )
                entry.until = self.clock() + self.rules_ttl
        return entry.applicable

    def invalidate(self, tenant_id: int | None = None) -> None:
        """Read the tenant's budgets (and its keys') again on its next request; None: every
        tenant's (a price changed)."""
        for (tenant, _), entry in self._rules.items():
            if tenant_id is None or tenant == tenant_id:
                entry.until = -math.inf

    # ---- admission ---------------------------------------------------------------------------

    async def check(self, caller: Caller) -> BudgetAdmission | None:
        """Raise the 429 of an exhausted budget of ``caller``; None: no budget applies."""
        if caller.tenant_id is None:
            return None
        tenant_id = int(caller.tenant_id)
        applicable = await self.applicable(tenant_id, caller.key_id)
        if not applicable.rules:
            return None
        writes = self._writes.get(tenant_id)
        if writes:  # this replica's finished requests are charged first
            await asyncio.wait(set(writes))
        states = await self._statuses(applicable)
        error = refusal(states, applicable.tenant_name)
        if error is not None:
            self._check_refused(applicable, states)
            raise error
        return BudgetAdmission(tenant_id, applicable, tuple(states), budget_headers(states))

    async def _statuses(self, applicable: Applicable) -> list[BudgetStatus]:
        now, base = self.now(), self.base_name()
        rules, prices = applicable.rules, applicable.prices
        settled = self.settled
        return await self.db.run(lambda s: store.statuses(s, rules, prices, base, now, settled))

    def track(self, record: RequestRecord, admission: BudgetAdmission) -> None:
        """``record``'s request was admitted under ``admission``: charge it when it ends."""
        self._by_record[id(record)] = admission

    # ---- charging ----------------------------------------------------------------------------

    def observe(self, record: RequestRecord) -> None:
        """Request-log observer (after the usage recorder's): write a budgeted request's usage
        row now, then look for crossings. Never waits."""
        admission = self._by_record.pop(id(record), None)
        if admission is None or not record.generated:  # no tokens, no row, nothing to charge
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a script): the recorder's flush writes it
            return
        tenant_id = admission.tenant_id
        write = loop.create_task(self.usage.flush(), name="budget-charge")
        writes = self._writes.setdefault(tenant_id, set())
        writes.add(write)
        write.add_done_callback(lambda t: self._written(tenant_id, t))
        tokens = (record.prompt_tokens, record.completion_tokens)
        check = loop.create_task(self._after(write, admission, tokens), name="budget-crossings")
        self._checks.add(check)
        check.add_done_callback(self._checks.discard)

    def _written(self, tenant_id: int, task: asyncio.Task[int]) -> None:
        writes = self._writes.get(tenant_id)
        if writes is not None:
            writes.discard(task)
            if not writes:
                del self._writes[tenant_id]
        if not task.cancelled() and task.exception() is not None:
            logger.error("writing budgeted usage rows failed: %s", task.exception())

    async def _after(
        self, write: asyncio.Task[int], admission: BudgetAdmission, tokens: tuple[int, int]
    ) -> None:
        try:
            await asyncio.wait({write})
            if self._may_cross(admission, tokens):
                await self.record_crossings(admission.applicable)
        except Exception:  # the next request's check records what this one missed
            logger.exception("checking budget crossings failed")

    # ---- crossings ---------------------------------------------------------------------------

    def _may_cross(self, admission: BudgetAdmission, tokens: tuple[int, int]) -> bool:
        """Whether the request that used ``tokens`` may have taken a budget over a threshold
        not yet recorded: its budgets' use at its admission plus its own tokens (a cost budget:
        always, its price is not at hand). Charges of other requests that ended meanwhile are
        not counted here: the next request's admission sees them, and its check records what
        this one missed."""
        now = self.now()
        for state in admission.states:
            rule = state.rule
            estimate = state.used + rule.prompt_weight * tokens[0]
            estimate += rule.completion_weight * tokens[1]
            levels = [("hard", rule.limit)]
            if rule.soft_percent is not None:
                levels.append(("soft", rule.limit * rule.soft_percent / 100.0))
            period = alert_period(rule, now)
            for level, threshold in levels:
                if (rule.id, period, level) in self._recorded:
                    continue
                if rule.metric == "cost" or estimate >= threshold:
                    return True
        return False

    def _check_refused(self, applicable: Applicable, states: list[BudgetStatus]) -> None:
        """A refusal: make sure the spent budget's hard limit is recorded (the charges that
        spent it may all have been checked before the others that ended beside them were in)."""
        unknown = [
            s for s in states
            if s.exceeded and (s.rule.id, alert_period(s.rule, s.now), "hard") not in self._recorded
        ]  # fmt: skip
        if unknown:
            check = asyncio.get_running_loop().create_task(
                self._after_refusal(applicable), name="budget-crossings"
            )
            self._checks.add(check)
            check.add_done_callback(self._checks.discard)

    async def _after_refusal(self, applicable: Applicable) -> None:
        try:
            await self.record_crossings(applicable)
        except Exception:
            logger.exception("checking budget crossings failed")

    def _remember(self, state: BudgetStatus, level: str) -> None:
        if len(self._recorded) >= MAX_REMEMBERED:
            self._recorded.clear()
        self._recorded.add((state.rule.id, alert_period(state.rule, state.now), level))

    def subscribe(self, listener: BudgetListener) -> None:
        """Call ``listener`` with every crossing this replica records."""
        self._listeners.append(listener)

    async def record_crossings(self, applicable: Applicable) -> list[BudgetEvent]:
        """Record the soft / hard crossings of ``applicable``'s budgets not yet recorded for
        their period; returns (and hands to the listeners) the ones this call recorded."""
        events: list[BudgetEvent] = []
        for state in await self._statuses(applicable):
            levels = [lvl for lvl, on in (("soft", state.soft_crossed), ("hard", state.exceeded))
                      if on]  # fmt: skip
            for level in levels:
                event = await self._record(state, level, applicable.tenant_name)
                if event is not None:
                    events.append(event)
        for event in events:
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:
                    logger.exception("a budget listener failed on %s", event.kind)
        return events

    async def _record(self, state: BudgetStatus, level: str, tenant: str) -> BudgetEvent | None:
        def write(session: Session) -> bool:
            if store.alerted(session, state, level):
                return False
            store.record_alert(session, state, level, tenant)
            return True

        try:
            recorded = await self.db.run(write)
        except IntegrityError:  # another replica recorded it first
            recorded = False
        self._remember(state, level)
        if not recorded:
            return None
        kind = "budget.soft_limit_crossed" if level == "soft" else "budget.hard_limit_reached"
        return BudgetEvent(kind, tenant, store.alert_facts(state))

    # ---- views -------------------------------------------------------------------------------

    async def tenant_statuses(
        self, tenant_id: int, key_public_id: str | None = None, *, every_key: bool = False
    ) -> tuple[str, list[BudgetStatus]]:
        """The tenant's name and the state of its budgets: those that apply to
        ``key_public_id`` (the tenant's and the key's), or with ``every_key`` all of them."""
        await self.usage.flush()  # read your own writes: buffered rows count too
        now, base = self.now(), self.base_name()

        def read(session: Session) -> tuple[str, list[BudgetStatus]]:
            if every_key:
                tenant = session.get(Tenant, tenant_id)
                if tenant is None:
                    return "", []
                rules: tuple[BudgetRule, ...] = tuple(store.tenant_rules(session, tenant))
                prices = store.load_prices(session)
                name = tenant.name
            else:
                found = store.applicable(session, tenant_id, key_public_id)
                name, rules, prices = found.tenant_name, found.rules, found.prices
            return name, store.statuses(session, rules, prices, base, now, self.settled)

        return await self.db.run(read)

    async def close(self) -> None:
        """Wait for the charges and crossing checks started so far (shutdown; tests)."""
        while self._writes or self._checks:
            tasks: list[asyncio.Task[Any]] = [t for g in self._writes.values() for t in g]
            tasks += list(self._checks)
            await asyncio.gather(*tasks, return_exceptions=True)
