"""The budget rules on plain records and on a real database: calendar windows (UTC day, ISO week,
month, across a year end), rolling windows and when they free up, weighted tokens, cost from the
price table (an adapter's own price, else its base model's; unpriced costs nothing), roll-ups
counted for a tenant's budget, the refusal's choice and the headers."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import random
from pathlib import Path

from loraplex.platform import budget_admin, budget_store, tenants
from loraplex.platform.budgets import (
    BudgetRule,
    BudgetStatus,
    Price,
    Prices,
    Spend,
    amount,
    budget_headers,
    fmt_reset,
    period_end,
    period_start,
    refusal,
    rolling_release,
)
from loraplex.platform.db.models import Adapter, AdapterVersion, UsageDaily, UsageRecord
from tests.utils.tenancy import platform_for

UTC = dt.timezone.utc


def _at(year: int, month: int, day: int, hour: int = 0) -> dt.datetime:
    return dt.datetime(year, month, day, hour, tzinfo=UTC)


def _rule(**fields: object) -> BudgetRule:
    base: dict[str, object] = dict(
        id=1, tenant_id=1, key_id=None, key_public_id=None, metric="tokens", period="day",
        anchor="calendar", limit=1000.0,
    )  # fmt: skip
    return BudgetRule(**(base | fields))  # type: ignore[arg-type]


def test_calendar_windows_are_utc_day_iso_week_and_month() -> None:
    now = dt.datetime(2026, 12, 31, 23, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5)))
    # 23:30 at UTC-5 is 04:30 UTC on 1 January 2027 (a Friday).
    assert period_start("day", now) == _at(2027, 1, 1)
    assert period_end("day", now) == _at(2027, 1, 2)
    assert period_start("week", now) == _at(2026, 12, 28)  # Monday
    assert period_end("week", now) == _at(2027, 1, 4)
    assert period_start("month", now) == _at(2027, 1, 1)
    assert period_end("month", _at(2027, 1, 31, 12)) == _at(2027, 2, 1)
    assert period_end("month", _at(2026, 12, 5)) == _at(2027, 1, 1)


def test_weighted_tokens_and_cost() -> None:
    spent = [
        Spend("base", None, 100, 10),
        Spend("pirate@2", 7, 1000, 100),
        Spend("caps@1", 8, 50, 5),
    ]
    weighted = _rule(prompt_weight=0.5, completion_weight=2.0)
    assert amount(weighted, spent, Prices(), "base") == 0.5 * 1150 + 2.0 * 115
    prices = Prices(base={"base": Price(1.0, 2.0)}, adapters={7: Price(10.0, 20.0)})
    cost = _rule(metric="cost")
    expected = (100 * 1 + 10 * 2 + 1000 * 10 + 100 * 20 + 50 * 1 + 5 * 2) / 1e6
    assert abs(amount(cost, spent, prices, "base") - expected) < 1e-12
    assert amount(cost, spent, Prices(), "base") == 0  # nothing priced: nothing spent


def test_a_rolling_budget_frees_up_as_its_oldest_charges_leave() -> None:
    rule = _rule(anchor="rolling", limit=100.0)
    charges = [(_at(2026, 1, 1, 1), 60.0), (_at(2026, 1, 1, 5), 30.0), (_at(2026, 1, 1, 9), 20.0)]
    # 110 used: below 100 once the first (60) leaves, a day after it.
    assert rolling_release(rule, 110.0, charges) == _at(2026, 1, 2, 1)
    big = _rule(anchor="rolling", limit=20.0)
    assert rolling_release(big, 110.0, charges) == _at(2026, 1, 2, 9)  # 110-60-30 = 20: not yet
    assert rolling_release(rule, 90.0, charges[:2]) == _at(2026, 1, 2, 1)  # not over: the oldest
    assert rolling_release(rule, 0.0, []) is None


def test_the_refusal_names_the_budget_that_frees_up_last_and_headers_the_tightest() -> None:
    now = _at(2026, 12, 5, 10)
    day = BudgetStatus(_rule(id=1, limit=100.0), 100.0, _at(2026, 12, 5), _at(2026, 12, 6), now)
    month = BudgetStatus(
        _rule(id=2, period="month", limit=1000.0), 1200.0, _at(2026, 12, 1), _at(2027, 1, 1), now
    )
    cost = BudgetStatus(
        _rule(id=3, metric="cost", limit=5.0, key_id=4, key_public_id="k1"),
        1.25, _at(2026, 12, 5), _at(2026, 12, 6), now,
    )  # fmt: skip
    error = refusal([day, month, cost], "acme")
    assert error is not None and error.status == 429 and error.code == "budget_exceeded"
    assert error.message.startswith("The monthly token budget of tenant 'acme' is spent:")
    assert "1,200 tokens used of 1,000 tokens" in error.message
    assert "2027-01-01T00:00:00Z" in error.message
    headers = error.headers or {}
    assert int(headers["Retry-After"]) == (_at(2027, 1, 1) - now).total_seconds()
    assert headers["x-ratelimit-remaining-budget-tokens"] == "0"
    assert headers["x-ratelimit-limit-budget-usd"] == "5.000000"
    assert headers["x-ratelimit-remaining-budget-usd"] == "3.750000"
    assert headers["x-ratelimit-reset-budget-usd"] == "14h0m0s"
    assert refusal([cost], "acme") is None
    assert budget_headers([cost])["x-ratelimit-limit-budget-usd"] == "5.000000"
    assert fmt_reset(0.2) == "1s" and fmt_reset(61) == "1m1s" and fmt_reset(3600) == "1h0m0s"


def test_statuses_read_the_usage_rows_and_roll_ups(tmp_path: Path) -> None:
    store = platform_for(tmp_path)
    try:
        with store.db.session() as session:
            tenant = tenants.create_tenant(session, "admin", "acme", quotas=tenants.Quotas())
            other = tenants.create_tenant(session, "admin", "globex", quotas=tenants.Quotas())
            key, _ = tenants.create_key(session, "admin", tenant)
            adapter = Adapter(tenant_id=tenant.id, name="pirate")
            session.add(adapter)
            session.flush()
            version = AdapterVersion(adapter_id=adapter.id, number=1, content_sha256="0" * 64)
            session.add(version)
            session.flush()
            now = _at(2026, 12, 5, 12)

            def row(t: int, at: dt.datetime, p: int, c: int, **more: object) -> None:
                fields: dict[str, object] = {"model": "tiny", **more}
                session.add(
                    UsageRecord(tenant_id=t, prompt_tokens=p, completion_tokens=c, status=200,
                                created_at=at, **fields)
                )  # fmt: skip

            row(tenant.id, _at(2026, 12, 5, 1), 100, 50, api_key_id=key.id)
            row(tenant.id, _at(2026, 12, 5, 2), 10, 5, model="pirate@1",
                adapter_version_id=version.id)  # fmt: skip
            row(tenant.id, _at(2026, 12, 4, 23), 1000, 0)  # yesterday
            row(other.id, _at(2026, 12, 5, 3), 7000, 0)  # another tenant
            session.add(UsageDaily(tenant_id=tenant.id, day=dt.date(2026, 12, 2), model="tiny",
                                   requests=1, prompt_tokens=300, completion_tokens=0))  # fmt: skip
            budget_admin.set_price(session, "admin", prompt=1.0, completion=2.0, base_model="tiny")
            budget_admin.set_price(session, "admin", prompt=100.0, completion=100.0,
                                   adapter=(tenant, adapter))  # fmt: skip
            session.flush()
            prices = budget_store.load_prices(session)

            def used(**fields: object) -> float:
                rule = _rule(tenant_id=tenant.id, **fields)
                return budget_store.status(session, rule, prices, "tiny", now).used

            assert used() == 165  # today's two rows
            assert used(key_id=key.id, key_public_id=key.public_id) == 150  # the key's own
            assert used(period="week") == 165 + 1000 + 300  # since Monday 30 Nov, roll-up too
            assert used(period="week", key_id=key.id) == 150  # roll-ups carry no key
            assert used(anchor="rolling") == 165 + 1000  # the last 24 hours
            cost = used(metric="cost")
            assert abs(cost - (100 * 1 + 50 * 2 + (10 + 5) * 100) / 1e6) < 1e-12
            state = budget_store.status(
                session, _rule(tenant_id=tenant.id, anchor="rolling", limit=1100.0), prices,
                "tiny", now,
            )  # fmt: skip
            # 1,165 used of 1,100: below once yesterday's 1,000 leaves, at 23:00 today.
            assert state.exceeded and state.resets_at == _at(2026, 12, 5, 23)
    finally:
        store.db.dispose()


def test_settled_days_change_no_figure(tmp_path: Path) -> None:
    """Budgets read through the cache of settled days (what admission uses) give the same used,
    and the same moment a rolling budget frees up, as reading every row: every period, anchor,
    metric and scope, at several moments, over 40 days of rows and roll-ups."""
    rng = random.Random(7)
    store = platform_for(tmp_path)
    try:
        with store.db.session() as session:
            tenant = tenants.create_tenant(session, "admin", "acme", quotas=tenants.Quotas())
            key, _ = tenants.create_key(session, "admin", tenant)
            adapter = Adapter(tenant_id=tenant.id, name="pirate")
            session.add(adapter)
            session.flush()
            version = AdapterVersion(adapter_id=adapter.id, number=1, content_sha256="0" * 64)
            session.add(version)
            session.flush()
            first = _at(2026, 11, 1)
            for day in range(3):  # rolled up: the oldest days
                session.add(UsageDaily(tenant_id=tenant.id, day=(first + dt.timedelta(day)).date(),
                                       model="pirate@1", requests=1, prompt_tokens=500,
                                       completion_tokens=100))  # fmt: skip
            for _ in range(600):
                at = first + dt.timedelta(days=3, seconds=rng.uniform(0, 37 * 86400))
                pirate = rng.random() < 0.3
                session.add(UsageRecord(
                    tenant_id=tenant.id, api_key_id=key.id if rng.random() < 0.5 else None,
                    model="pirate@1" if pirate else "tiny",
                    adapter_version_id=version.id if pirate else None,
                    prompt_tokens=rng.randint(1, 200), completion_tokens=rng.randint(0, 100),
                    status=200, created_at=at,
                ))  # fmt: skip
            budget_admin.set_price(session, "admin", prompt=3.0, completion=5.0, base_model="tiny")
            budget_admin.set_price(session, "admin", prompt=7.0, completion=11.0,
                                   adapter=(tenant, adapter))  # fmt: skip
            session.flush()
            prices = budget_store.load_prices(session)
            settled = budget_store.SettledDays()
            checked = 0
            for now in (_at(2026, 12, 9, 13), _at(2026, 12, 1, 0), _at(2026, 11, 20, 7)):
                for period, anchor, metric, scoped in itertools.product(
                    ("day", "week", "month"), ("calendar", "rolling"), ("tokens", "cost"),
                    (False, True),
                ):  # fmt: skip
                    plain = _rule(tenant_id=tenant.id, period=period, anchor=anchor, metric=metric,
                                  key_id=key.id if scoped else None,
                                  prompt_weight=0.5)  # fmt: skip
                    exact = budget_store.status(session, plain, prices, "tiny", now)
                    # Limits that put it just under, at and over half its use: all three paths.
                    for limit in (exact.used * 1.01 + 1, exact.used / 2, exact.used / 7):
                        rule = dataclasses.replace(plain, limit=max(limit, 1e-9))
                        want = budget_store.status(session, rule, prices, "tiny", now)
                        got = budget_store.status(session, rule, prices, "tiny", now, settled)
                        assert abs(got.used - want.used) <= 1e-9 * max(1.0, want.used), rule
                        assert got.resets_at == want.resets_at, (rule, now)
                        checked += 1
            assert checked == 3 * 24 * 3 and len(settled) > 0
    finally:
        store.db.dispose()


def test_a_tenant_created_under_a_deleted_ones_id_starts_from_nothing(tmp_path: Path) -> None:
    """SQLite may give a new tenant the id of a deleted one: the settled days cached for the
    deleted tenant are not the new one's."""
    store = platform_for(tmp_path)
    settled = budget_store.SettledDays()
    now = _at(2026, 12, 20, 12)
    try:
        with store.db.session() as session:
            old = tenants.create_tenant(session, "admin", "acme", quotas=tenants.Quotas())
            session.add(UsageRecord(tenant_id=old.id, model="tiny", prompt_tokens=500,
                                    completion_tokens=0, status=200,
                                    created_at=_at(2026, 12, 10)))  # fmt: skip
        with store.db.session() as session:
            rule = _rule(tenant_id=old.id, period="month", owner=old.cache_salt)
            state = budget_store.status(session, rule, Prices(), "tiny", now, settled)
            assert state.used == 500 and len(settled) > 0
            session.delete(session.get(type(old), old.id))
        with store.db.session() as session:
            new = tenants.create_tenant(session, "admin", "globex", quotas=tenants.Quotas())
            assert new.id == old.id  # the id came back
            rule = _rule(tenant_id=new.id, period="month", owner=new.cache_salt)
            assert budget_store.status(session, rule, Prices(), "tiny", now, settled).used == 0
    finally:
        store.db.dispose()
