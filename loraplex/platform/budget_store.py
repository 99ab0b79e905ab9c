"""Budgets in the database: what applies to a request, what a budget has used (from the usage
rows, through ``TenantScope``) and the recorded crossings. The rules are ``budgets``; the
operator's changes ``budget_admin``.

Used = the tenant's (or key's) ``usage_records`` rows created in the window, plus, for a
tenant's budget, its ``usage_daily`` roll-ups of whole days in the window (raw rows older than
``usage_retention_days`` are rolled up by day and model, without their key: a key's budget over
a window longer than the retention counts the raw rows only).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Unpack

from sqlalchemy import Select, func, or_, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from loraplex.platform import audit
from loraplex.platform.budgets import (
    ROLLING,
    BudgetRule,
    BudgetStatus,
    Price,
    Prices,
    Spend,
    alert_period,
    amount,
    period_end,
    rolling_release,
    window_start,
)
from loraplex.platform.db.models import (
    Adapter,
    AdapterVersion,
    ApiKey,
    Budget,
    BudgetAlert,
    ModelPrice,
    Tenant,
    UsageDaily,
    UsageRecord,
)
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.usage import utc_day

SYSTEM_ACTOR = "system"


@dataclass(frozen=True)
class Applicable:
    """The budgets that apply to a caller (its tenant's and its key's) and what they need."""

    tenant_name: str
    rules: tuple[BudgetRule, ...]
    prices: Prices


def _rule(budget: Budget, public_id: str | None, owner: str) -> BudgetRule:
    return BudgetRule(
        id=budget.id,
        tenant_id=budget.tenant_id,
        key_id=budget.api_key_id,
        key_public_id=public_id,
        metric=budget.metric,
        period=budget.period,
        anchor=budget.anchor,
        limit=budget.limit_amount,
        soft_percent=budget.soft_percent,
        prompt_weight=budget.prompt_weight,
        completion_weight=budget.completion_weight,
        owner=owner,
    )


def _rules(session: Session, tenant_id: int, *where: Any) -> list[BudgetRule]:
    query = (
        TenantScope(session, tenant_id)
        .select(Budget)
        .add_columns(ApiKey.public_id)
        .outerjoin(ApiKey, Budget.api_key_id == ApiKey.id)
        .where(*where)
        .order_by(Budget.api_key_id.is_not(None), Budget.id)
    )
    tenant = session.get(Tenant, tenant_id)
    owner = tenant.cache_salt if tenant is not None else ""
    rows = session.execute(query).tuples()
    return [_rule(budget, public_id, owner) for budget, public_id in rows]


def applicable(session: Session, tenant_id: int, key_public_id: str | None) -> Applicable:
    """The budgets of tenant ``tenant_id`` and of its key ``key_public_id`` (if any)."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        return Applicable("", (), Prices())
    key = TenantScope(session, tenant_id).key(key_public_id) if key_public_id else None
    mine: ColumnElement[bool] = Budget.api_key_id.is_(None)
    if key is not None:
        mine = or_(mine, Budget.api_key_id == key.id)
    rules = tuple(_rules(session, tenant_id, mine))
    prices = load_prices(session) if any(r.metric == "cost" for r in rules) else Prices()
    return Applicable(tenant.name, rules, prices)


def tenant_rules(session: Session, tenant: Tenant) -> list[BudgetRule]:
    """Every budget of ``tenant``: its own first, then its keys'."""
    return _rules(session, tenant.id)


def load_prices(session: Session) -> Prices:
    base: dict[str, Price] = {}
    adapters: dict[int, Price] = {}
    for row in session.scalars(select(ModelPrice)):
        price = Price(row.prompt_per_million, row.completion_per_million)
        if row.adapter_id is not None:
            adapters[row.adapter_id] = price
        elif row.base_model is not None:
            base[row.base_model] = price
    return Prices(base, adapters)


# ---- what a budget has used -------------------------------------------------------------------
#
# A window, cut at UTC midnights (``now`` on day T):
#
#   start ....| D1 | D2 | ... | T-2 |...... T-1 ...... T ...... now
#   head      | settled days          | tail
#
# A settled day ended at least a day ago: every request that arrived in it has long ended and
# its row is written, so its sums never change (retention moves a tenant's rows into the
# roll-ups without changing their sums). ``SettledDays`` keeps them per tenant, key and day;
# each admission reads only the head (under a day, for rolling windows) and the tail (at most
# two days) from the rows.

_MAX_DAYS = 31  # the longest window's whole days


def _ceil_day(moment: dt.datetime) -> dt.datetime:
    day = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    return day if day == moment else day + dt.timedelta(days=1)


def _spend_query(
    session: Session, rule: BudgetRule, lo: dt.datetime, hi: dt.datetime | None, by: str
) -> list[Spend]:
    """The usage rows of ``rule``'s tenant (or key) created in ``[lo, hi)`` (``hi`` None:
    open), with the tenant's roll-ups of the whole days in it: ``by`` "sum" (per model and
    adapter), "day" (per day, model and adapter; ``at`` the day's midnight) or "row" (each
    row, oldest first)."""
    scope = TenantScope(session, rule.tenant_id)
    adapter_id = AdapterVersion.adapter_id
    rows = scope.select(UsageRecord).where(UsageRecord.created_at >= lo)
    if hi is not None:
        rows = rows.where(UsageRecord.created_at < hi)
    if rule.key_id is not None:
        rows = rows.where(UsageRecord.api_key_id == rule.key_id)
    p, c = UsageRecord.prompt_tokens, UsageRecord.completion_tokens
    day = utc_day(UsageRecord.created_at, session)
    raw: Select[Unpack[tuple[Any, ...]]]
    if by == "row":
        raw = rows.with_only_columns(UsageRecord.created_at, UsageRecord.model, adapter_id, p, c)
        raw = raw.order_by(UsageRecord.created_at)
    elif by == "day":
        by_day = (day, UsageRecord.model, adapter_id, func.sum(p), func.sum(c))
        raw = rows.with_only_columns(*by_day).group_by(day, UsageRecord.model, adapter_id)
    else:
        summed = (UsageRecord.model, adapter_id, func.sum(p), func.sum(c))
        raw = rows.with_only_columns(*summed).group_by(UsageRecord.model, adapter_id)
    raw = raw.outerjoin(AdapterVersion, UsageRecord.adapter_version_id == AdapterVersion.id)
    out: list[Spend] = []
    if rule.key_id is None:  # roll-ups: whole UTC days in the range, tenant-wide only
        daily = scope.select(UsageDaily).where(UsageDaily.day >= _ceil_day(lo).date())
        if hi is not None:
            daily = daily.where(UsageDaily.day < hi.date())
        for d in session.scalars(daily.order_by(UsageDaily.day)):
            assert isinstance(d, UsageDaily)
            at = _midnight(d.day) if by != "sum" else None
            out.append(Spend(d.model, None, d.prompt_tokens, d.completion_tokens, at))
    for row in session.execute(raw):
        if by == "row":
            at, model, adapter, prompt, completion = row
            out.append(Spend(model, adapter, int(prompt), int(completion), at))
        elif by == "day":
            when, model, adapter, prompt, completion = row
            out.append(Spend(model, adapter, int(prompt or 0), int(completion or 0),
                             _midnight(_as_date(when))))  # fmt: skip
        else:
            model, adapter, prompt, completion = row
            out.append(Spend(model, adapter, int(prompt or 0), int(completion or 0)))
    if by == "row" and rule.key_id is None:
        out.sort(key=lambda s: s.at or lo)  # roll-ups (midnights) among the rows
    return _name_adapters(scope, out) if rule.metric == "cost" else out


def _midnight(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time(0), dt.timezone.utc)


def _as_date(value: Any) -> dt.date:
    return value if isinstance(value, dt.date) else dt.date.fromisoformat(str(value)[:10])


def _name_adapters(scope: TenantScope, spent: list[Spend]) -> list[Spend]:
    """Rows whose adapter version is gone (or roll-ups, which keep only ``name@N``) find their
    adapter by name, for its price."""
    unnamed = [s for s in spent if s.adapter_id is None and "@" in s.model]
    if not unnamed:
        return spent
    ids = {a.name: a.id for a in scope.all(Adapter)}
    out = []
    for s in spent:
        if s.adapter_id is None and "@" in s.model:
            s = Spend(s.model, ids.get(s.model.rsplit("@", 1)[0]), s.prompt_tokens,
                      s.completion_tokens, s.at)  # fmt: skip
        out.append(s)
    return out


class SettledDays:
    """Per tenant, key (None: the tenant's) and settled UTC day: its usage by model and adapter.
    The tenant is also keyed by ``BudgetRule.owner``, so a tenant created again under a deleted
    one's id (SQLite may reuse it) never reads the deleted one's days.
    Bounded: days older than the longest window are dropped, and past ``max_entries`` all.
    Owned by one ``BudgetManager``, whose sessions run in worker threads: a lock guards the
    dict; two fills of one day at once store the same (immutable) sums."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._days: dict[tuple[str, int, int | None, dt.date], list[Spend]] = {}
        self._lock = threading.Lock()  # sessions run in worker threads

    def __len__(self) -> int:
        return len(self._days)

    def get(
        self, session: Session, rule: BudgetRule, days: list[dt.date]
    ) -> dict[dt.date, list[Spend]]:
        scope = (rule.owner, rule.tenant_id, rule.key_id)
        with self._lock:
            missing = [d for d in days if (*scope, d) not in self._days]
        if missing:
            filled: dict[dt.date, list[Spend]] = {d: [] for d in missing}
            lo, hi = _midnight(min(missing)), _midnight(max(missing) + dt.timedelta(days=1))
            for one in _spend_query(session, _named(rule), lo, hi, "day"):
                assert one.at is not None
                if one.at.date() in filled:
                    filled[one.at.date()].append(one)
            with self._lock:
                self._trim(min(days))
                for d, day_spend in filled.items():
                    self._days[(*scope, d)] = day_spend
        with self._lock:
            return {d: self._days.get((*scope, d), []) for d in days}

    def _trim(self, oldest: dt.date) -> None:
        horizon = oldest - dt.timedelta(days=_MAX_DAYS)
        if len(self._days) >= self.max_entries:
            for key in [k for k in self._days if k[3] < horizon]:
                del self._days[key]
        if len(self._days) >= self.max_entries:
            self._days.clear()


def _named(rule: BudgetRule) -> BudgetRule:
    """``rule``'s scope with adapters named (a cost rule's): what a cached day keeps serves
    every budget of that tenant or key."""
    return dataclasses.replace(rule, metric="cost")


def spend(
    session: Session,
    rule: BudgetRule,
    start: dt.datetime,
    now: dt.datetime,
    settled: SettledDays | None = None,
) -> list[Spend]:
    """The usage in ``rule``'s window from ``start`` to ``now`` (with ``settled``: its settled
    days from there), summed per model and adapter (and per day for the settled ones)."""
    head_end, tail_start = _cuts(start, now) if settled is not None else (None, None)
    if settled is None or head_end is None or tail_start is None:
        return _spend_query(session, rule, start, None, "sum")
    out = _spend_query(session, rule, start, head_end, "sum") if start < head_end else []
    for spent in settled.get(session, rule, _days(head_end, tail_start)).values():
        out += spent
    return out + _spend_query(session, rule, tail_start, None, "sum")


def _cuts(start: dt.datetime, now: dt.datetime) -> tuple[dt.datetime | None, dt.datetime | None]:
    """(end of the head, start of the tail); (None, None) when no whole settled day lies
    between."""
    head_end = _ceil_day(start)
    tail_start = now.replace(hour=0, minute=0, second=0, microsecond=0) - dt.timedelta(days=1)
    return (head_end, tail_start) if head_end < tail_start else (None, None)


def _days(lo: dt.datetime, hi: dt.datetime) -> list[dt.date]:
    return [(lo + dt.timedelta(days=i)).date() for i in range((hi - lo).days)]


def _release(
    session: Session,
    rule: BudgetRule,
    prices: Prices,
    base_name: str,
    used: float,
    start: dt.datetime,
    now: dt.datetime,
    settled: SettledDays | None,
) -> dt.datetime | None:
    """When a rolling budget that used ``used`` frees up (``rolling_release``), reading rows
    one by one only where its release falls: the head, the settled day it falls in, the tail."""

    def charges(lo: dt.datetime, hi: dt.datetime | None) -> list[tuple[dt.datetime, float]]:
        rows = _spend_query(session, rule, lo, hi, "row")
        return [(s.at, amount(rule, (s,), prices, base_name)) for s in rows if s.at is not None]

    if used < rule.limit:  # not over: when its oldest charge leaves
        oldest = _oldest(session, rule, start)
        return oldest + ROLLING[rule.period] if oldest is not None else None
    head_end, tail_start = _cuts(start, now) if settled is not None else (None, None)
    if settled is None or head_end is None or tail_start is None:
        return rolling_release(rule, used, charges(start, None))
    walked = charges(start, head_end)
    days = settled.get(session, rule, _days(head_end, tail_start))
    need = used - rule.limit  # what must leave (more than this) for one more request
    freed = sum(a for _, a in walked)
    if freed > need:
        return rolling_release(rule, used, walked)
    for day, spent in days.items():
        charged = amount(rule, spent, prices, base_name)
        if freed + charged > need:  # it frees up during this day: its rows tell when
            walked += charges(_midnight(day), _midnight(day + dt.timedelta(days=1)))
            return rolling_release(rule, used, walked)
        freed += charged
        if charged > 0:
            walked.append((_midnight(day), charged))
    walked += charges(tail_start, None)
    return rolling_release(rule, used, walked)


def _oldest(session: Session, rule: BudgetRule, start: dt.datetime) -> dt.datetime | None:
    """When the oldest usage in ``rule``'s window from ``start`` was charged."""
    scope = TenantScope(session, rule.tenant_id)
    rows = scope.select(UsageRecord).where(UsageRecord.created_at >= start)
    if rule.key_id is not None:
        rows = rows.where(UsageRecord.api_key_id == rule.key_id)
    found: list[dt.datetime] = []
    if rule.key_id is None:
        day = session.scalar(
            scope.select(UsageDaily)
            .where(UsageDaily.day >= _ceil_day(start).date())
            .with_only_columns(func.min(UsageDaily.day))
        )
        if day is not None:
            found.append(_midnight(_as_date(day)))
    oldest = session.scalar(rows.with_only_columns(func.min(UsageRecord.created_at)))
    if oldest is not None:
        found.append(_aware(oldest))
    return min(found) if found else None


def _aware(value: Any) -> dt.datetime:
    """A ``MIN`` of a timestamp column, as the aware UTC datetime the column type gives rows."""
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
    return dt.datetime.fromisoformat(str(value)).replace(tzinfo=dt.timezone.utc)


def status(
    session: Session,
    rule: BudgetRule,
    prices: Prices,
    base_name: str,
    now: dt.datetime,
    settled: SettledDays | None = None,
) -> BudgetStatus:
    """``rule``'s state at ``now`` (a rolling budget also finds when it frees up)."""
    start = window_start(rule, now)
    used = amount(rule, spend(session, rule, start, now, settled), prices, base_name)
    if rule.anchor == "calendar":
        resets: dt.datetime | None = period_end(rule.period, now)
    elif used <= 0:
        resets = None
    else:
        resets = _release(session, rule, prices, base_name, used, start, now, settled)
    return BudgetStatus(rule, used, start, resets, now)


def statuses(
    session: Session,
    rules: Iterable[BudgetRule],
    prices: Prices,
    base_name: str,
    now: dt.datetime,
    settled: SettledDays | None = None,
) -> list[BudgetStatus]:
    return [status(session, rule, prices, base_name, now, settled) for rule in rules]


# ---- crossings ---------------------------------------------------------------------------------


def alerted(session: Session, state: BudgetStatus, level: str) -> bool:
    """Whether ``level`` ("soft" or "hard") was recorded for ``state``'s budget and period."""
    period = alert_period(state.rule, state.now)
    found = session.scalar(
        select(BudgetAlert.id).where(
            BudgetAlert.budget_id == state.rule.id,
            BudgetAlert.period_start == period,
            BudgetAlert.level == level,
        )
    )
    return found is not None


def record_alert(session: Session, state: BudgetStatus, level: str, tenant_name: str) -> None:
    """Record a crossing (its row and its audit event ``budget.soft_limit_crossed`` or
    ``budget.hard_limit_reached``); a second replica's insert of the same one fails on the
    unique key and rolls back, audit event included."""
    rule = state.rule
    session.add(
        BudgetAlert(
            budget_id=rule.id,
            period_start=alert_period(rule, state.now),
            level=level,
            used=state.used,
        )
    )
    session.flush()
    action = "budget.soft_limit_crossed" if level == "soft" else "budget.hard_limit_reached"
    audit.record(
        session,
        SYSTEM_ACTOR,
        action,
        "budget",
        str(rule.id),
        tenant_name=tenant_name,
        after=alert_facts(state),
    )


def alert_facts(state: BudgetStatus) -> dict[str, Any]:
    rule = state.rule
    return {
        "budget_id": rule.id,
        "key": rule.key_public_id,
        "metric": rule.metric,
        "period": rule.period,
        "anchor": rule.anchor,
        "limit": rule.limit,
        "soft_percent": rule.soft_percent,
        "used": round(state.used, 6),
        "window_start": state.start.isoformat(),
        "resets_at": state.resets_at.isoformat() if state.resets_at else None,
    }
