"""What a budget check costs at admission: ``budget_store.statuses`` for one tenant with
``--rows`` usage rows spread over the last 30 days, reading every row or with the settled days
cached (what ``BudgetManager`` does), for calendar day / month and rolling month budgets, under
and over their limit.

    python -m benchmarks.budget_status [--rows 100000] [--postgres]

``--postgres`` runs on a PostgreSQL server started for the run (tests/utils/pg.py), else on a
SQLite file. Prints one line per case: the first call (it fills the cache) and the median of
the next 20.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import insert

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loraplex.platform import budget_store, tenants
from loraplex.platform.budgets import BudgetRule, Prices
from loraplex.platform.db.models import UsageRecord
from tests.utils.tenancy import platform_for

CASES = (
    ("day", "calendar", 1e12),
    ("month", "calendar", 1e12),
    ("month", "rolling", 1e12),
    ("month", "rolling", 1.0),  # over: finds when it frees up
)


def run(rows: int, url: str | None) -> None:
    store = platform_for(Path(tempfile.mkdtemp()), **({"database_url": url} if url else {}))
    now = dt.datetime.now(dt.timezone.utc)
    with store.db.session() as session:
        tenant_id = tenants.create_tenant(session, "admin", "acme", quotas=tenants.Quotas()).id
    start = now - dt.timedelta(days=30)
    span = (now - start).total_seconds()
    batch = [
        {
            "tenant_id": tenant_id,
            "model": "tiny" if i % 3 else "pirate@1",
            "prompt_tokens": 50,
            "completion_tokens": 20,
            "status": 200,
            "created_at": start + dt.timedelta(seconds=span * i / rows),
        }
        for i in range(rows)
    ]
    with store.db.session() as session:
        for i in range(0, rows, 10_000):
            session.execute(insert(UsageRecord), batch[i : i + 10_000])
    for period, anchor, limit in CASES:
        rule = BudgetRule(1, tenant_id, None, None, "tokens", period, anchor, limit)
        for cached in (False, True):
            settled = budget_store.SettledDays() if cached else None
            times = []
            for _ in range(21):
                began = time.perf_counter()
                with store.db.session() as session:
                    at = dt.datetime.now(dt.timezone.utc)
                    budget_store.statuses(session, [rule], Prices(), "tiny", at, settled)
                times.append(time.perf_counter() - began)
            how = "settled days cached" if cached else "every row"
            print(
                f"{rows} rows in 30 days, {period} {anchor}, limit {limit:g}, {how}: "
                f"first {times[0] * 1000:.1f} ms, median {statistics.median(times[1:]) * 1000:.2f} ms"
            )
    store.db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--postgres", action="store_true")
    args = parser.parse_args()
    if not args.postgres:
        run(args.rows, None)
        return
    from tests.utils.pg import PostgresServer

    server = PostgresServer.start()
    try:
        run(args.rows, server.create_database())
    finally:
        server.stop()


if __name__ == "__main__":
    main()
