"""Budgets: per tenant and per key, a limit on what its requests spend over a day, a week or a
month, as tokens (prompt + completion, each optionally weighted) or as a cost (US dollars, from
the operator's price table: per base model and per adapter, per million prompt / completion
tokens). The rules, on plain records; the database side is ``budget_store``, admission and
alerts ``budget_manager``.

Windows are UTC. ``calendar``: the current day (from midnight), ISO week (from Monday 00:00) or
month (from the 1st); the budget resets at the next one. ``rolling``: the last 24 hours, 7 days
or 30 days; usage leaves the window as it ages, so the budget frees up by degrees.

What a budget has used is what the usage rows of its tenant (or key) say for the window: the
same rows ``GET /v1/usage`` reports, so the two always agree. A request is admitted while every
budget that applies to it has used less than its limit (**hard**); requests already running
when one crosses the limit finish and are charged in full, the next one is refused (429
``budget_exceeded``). So a budget is exceeded by at most the tokens of the requests in flight
when it was reached. A **soft** limit (a percentage of the limit) refuses nothing: its crossing
is recorded (``budget_manager``) for alerts.

Cost: an adapter request costs its adapter's price where the operator set one, else its base
model's; a model without a price costs nothing.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from loraplex.platform.errors import APIError

BudgetMetric = Literal["tokens", "cost"]
BudgetPeriod = Literal["day", "week", "month"]
BudgetAnchor = Literal["calendar", "rolling"]

METRICS: tuple[str, ...] = ("tokens", "cost")
PERIODS: tuple[str, ...] = ("day", "week", "month")
ANCHORS: tuple[str, ...] = ("calendar", "rolling")
ROLLING: dict[str, dt.timedelta] = {
    "day": dt.timedelta(days=1),
    "week": dt.timedelta(days=7),
    "month": dt.timedelta(days=30),
}
ADJECTIVE = {"day": "daily", "week": "weekly", "month": "monthly"}
HEADER_UNIT = {"tokens": "tokens", "cost": "usd"}
PER_MILLION = 1_000_000.0


@dataclass(frozen=True)
class BudgetRule:
    """One budget, as admission reads it (from a ``Budget`` row)."""

    id: int
    tenant_id: int
    key_id: int | None  # None: the tenant's budget, over all its keys
    key_public_id: str | None
    metric: str  # BudgetMetric
    period: str  # BudgetPeriod
    anchor: str  # BudgetAnchor
    limit: float
    soft_percent: float | None = None
    prompt_weight: float = 1.0
    completion_weight: float = 1.0
    # The tenant's cache salt: what tells a tenant from a deleted one whose id it reuses.
    owner: str = ""

    @property
    def scope(self) -> str:
        return "tenant" if self.key_id is None else "key"

    def describe(self, tenant_name: str) -> str:
        """``the daily token budget of tenant 'acme'`` (what a refusal and the UI call it)."""
        what = "token" if self.metric == "tokens" else "cost"
        rolling = " (rolling)" if self.anchor == "rolling" else ""
        owner = f"tenant {tenant_name!r}"
        if self.key_public_id is not None:
            owner = f"key {self.key_public_id!r} of {owner}"
        return f"the {ADJECTIVE[self.period]}{rolling} {what} budget of {owner}"


@dataclass(frozen=True)
class Price:
    prompt_per_million: float
    completion_per_million: float

    def cost(self, prompt: int, completion: int) -> float:
        return (prompt * self.prompt_per_million + completion * self.completion_per_million) / (
            PER_MILLION
        )


@dataclass(frozen=True)
class Prices:
    """The operator's price table: base models by served name, adapters by id."""

    base: dict[str, Price] = field(default_factory=dict)
    adapters: dict[int, Price] = field(default_factory=dict)

    def of(self, model: str, adapter_id: int | None, base_name: str) -> Price | None:
        if adapter_id is not None:
            price = self.adapters.get(adapter_id)
            return price if price is not None else self.base.get(base_name)
        return self.base.get(model)


@dataclass(frozen=True)
class Spend:
    """Tokens of one model (and adapter: its id, None for the base) in a window; ``at``: when,
    for rolling windows' release times (None: summed over the window)."""

    model: str
    adapter_id: int | None
    prompt_tokens: int
    completion_tokens: int
    at: dt.datetime | None = None


def amount(rule: BudgetRule, spend: Iterable[Spend], prices: Prices, base_name: str) -> float:
    """What ``spend`` counts against ``rule``: weighted tokens or dollars."""
    total = 0.0
    for s in spend:
        if rule.metric == "tokens":
            total += rule.prompt_weight * s.prompt_tokens
            total += rule.completion_weight * s.completion_tokens
        else:
            price = prices.of(s.model, s.adapter_id, base_name)
            if price is not None:
                total += price.cost(s.prompt_tokens, s.completion_tokens)
    return total


# ---- windows ------------------------------------------------------------------------------------


def period_start(period: str, now: dt.datetime) -> dt.datetime:
    """The start of the calendar ``period`` (UTC) that holds ``now``."""
    day = now.astimezone(dt.timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "week":
        return day - dt.timedelta(days=day.weekday())
    if period == "month":
        return day.replace(day=1)
    return day


def period_end(period: str, now: dt.datetime) -> dt.datetime:
    """When the calendar ``period`` that holds ``now`` ends (the next one starts)."""
    start = period_start(period, now)
    if period == "week":
        return start + dt.timedelta(days=7)
    if period == "month":
        return (start + dt.timedelta(days=32)).replace(day=1)
    return start + dt.timedelta(days=1)


def window_start(rule: BudgetRule, now: dt.datetime) -> dt.datetime:
    if rule.anchor == "rolling":
        return now - ROLLING[rule.period]
    return period_start(rule.period, now)


def alert_period(rule: BudgetRule, now: dt.datetime) -> float:
    """The key under which a crossing is recorded once: the calendar period's start; for a
    rolling budget, the start of the current stretch of its length since the epoch (so a
    rolling budget's crossing is recorded at most once per window length)."""
    if rule.anchor == "rolling":
        span = ROLLING[rule.period].total_seconds()
        return math.floor(now.timestamp() / span) * span
    return period_start(rule.period, now).timestamp()


# ---- a budget's state --------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetStatus:
    """``rule`` at ``now``: ``used`` in the window from ``start``; ``resets_at``: when the
    budget is back to zero (calendar), or for a rolling one when its use falls below the limit
    (when over) or its oldest charge leaves the window (None: nothing charged)."""

    rule: BudgetRule
    used: float
    start: dt.datetime
    resets_at: dt.datetime | None
    now: dt.datetime

    @property
    def exceeded(self) -> bool:
        return self.used >= self.rule.limit

    @property
    def soft_crossed(self) -> bool:
        soft = self.rule.soft_percent
        return soft is not None and self.used >= self.rule.limit * soft / 100.0

    @property
    def remaining(self) -> float:
        return max(0.0, self.rule.limit - self.used)

    @property
    def fraction(self) -> float:
        """Used / limit, in [0, 1] (for bars)."""
        return min(1.0, self.used / self.rule.limit) if self.rule.limit > 0 else 1.0

    def seconds_to_reset(self) -> float:
        if self.resets_at is None:
            return 0.0
        return max(0.0, (self.resets_at - self.now).total_seconds())


def rolling_release(
    rule: BudgetRule,
    used: float,
    charges: Sequence[tuple[dt.datetime, float]],
) -> dt.datetime | None:
    """When a rolling budget's use falls below its limit (``charges``: (when, amount) in the
    window, oldest first, adding up to ``used``); when not over, when the oldest leaves."""
    span = ROLLING[rule.period]
    if not charges:
        return None
    if used < rule.limit:
        return charges[0][0] + span
    freed = 0.0
    for at, charged in charges:
        freed += charged
        if used - freed < rule.limit:
            return at + span
    return charges[-1][0] + span


# ---- what a client is told ---------------------------------------------------------------------


def fmt_amount(metric: str, value: float) -> str:
    """``1,234 tokens`` or ``$1.2345``."""
    if metric == "tokens":
        return f"{math.ceil(value - 1e-9):,} tokens"
    return f"${value:,.4f}"


def header_amount(metric: str, value: float) -> str:
    if metric == "tokens":
        return str(max(0, math.floor(value + 1e-9)))
    return f"{max(0.0, value):.6f}"


def fmt_reset(seconds: float) -> str:
    """A duration in the style of the ``x-ratelimit-reset-*`` headers: ``45s``, ``3m20s``,
    ``15h4m0s``."""
    whole = max(0, math.ceil(seconds - 1e-9))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def refusal(statuses: Sequence[BudgetStatus], tenant_name: str) -> APIError | None:
    """The 429 for the first exhausted budget (the one that frees up last), or None."""
    over = [s for s in statuses if s.exceeded]
    if not over:
        return None
    status = max(over, key=lambda s: s.seconds_to_reset())
    rule = status.rule
    wait = status.seconds_to_reset()
    when = (
        f"it resets at {iso(status.resets_at)} (in {fmt_reset(wait)})"
        if status.resets_at is not None
        else "it frees up as its usage leaves the window"
    )
    headers = {"Retry-After": str(max(1, math.ceil(wait)))}
    headers |= budget_headers(statuses)
    if status.resets_at is not None:
        headers["x-budget-reset-at"] = iso(status.resets_at)
    return APIError(
        429,
        f"{rule.describe(tenant_name).capitalize()} is spent: "
        f"{fmt_amount(rule.metric, status.used)} used of {fmt_amount(rule.metric, rule.limit)}; "
        f"{when}. Retry then, or ask the operator to raise the budget.",
        type="budget",
        code="budget_exceeded",
        headers=headers,
    )


def budget_headers(statuses: Sequence[BudgetStatus]) -> dict[str, str]:
    """``x-ratelimit-{limit,remaining,reset}-budget-{tokens,usd}``: per metric, the budget
    with the least left (its share of the limit)."""
    headers: dict[str, str] = {}
    for metric in METRICS:
        mine = [s for s in statuses if s.rule.metric == metric]
        if not mine:
            continue
        tight = min(mine, key=lambda s: s.remaining / s.rule.limit if s.rule.limit else 0.0)
        unit = HEADER_UNIT[metric]
        headers[f"x-ratelimit-limit-budget-{unit}"] = header_amount(metric, tight.rule.limit)
        headers[f"x-ratelimit-remaining-budget-{unit}"] = header_amount(metric, tight.remaining)
        headers[f"x-ratelimit-reset-budget-{unit}"] = fmt_reset(tight.seconds_to_reset())
    return headers
