"""The Usage page: its table and charts add up to the database's rows (raw and rolled up), its
filters, and the CSV export (same rows, an attachment, no spreadsheet formulas)."""

from __future__ import annotations

import csv
import datetime as dt
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from loraplex.platform import tenants
from loraplex.platform import usage as usage_reports
from loraplex.platform.db.models import Tenant, UsageDaily, UsageRecord, utcnow
from loraplex.webui import usage as usage_page
from tests.utils.registry_web import field_errors, mount_pages, table_rows
from tests.utils.web import WebEnv, sign_in

pytestmark = pytest.mark.anyio

DAY = dt.timedelta(days=1)


@pytest.fixture
def today(monkeypatch: pytest.MonkeyPatch) -> dt.date:
    """The reports' clock pinned for the test, so that the page's default range and the test's
    expectations name the same days even when a run crosses midnight UTC."""
    now = utcnow()
    monkeypatch.setattr(usage_reports, "utcnow", lambda: now)
    return now.date()


@pytest.fixture
def web(tmp_path: Path) -> Iterator[WebEnv]:
    env = WebEnv.build(tmp_path)
    mount_pages(env.app, env.webui)
    try:
        yield env
    finally:
        env.close()


def seed(env: WebEnv, today: dt.date) -> dict[str, int]:
    """Usage of two tenants and the operator over the last days, raw rows and a roll-up."""
    noon = dt.datetime.combine(today, dt.time(12), tzinfo=dt.timezone.utc)
    with env.store.db.session() as session:
        ids = {
            name: tenants.create_tenant(session, "admin", name, quotas=tenants.Quotas()).id
            for name in ("acme", "beta")
        }

        def row(tenant: str | None, model: str, days_ago: int, prompt: int, completion: int,
                status: int = 200) -> UsageRecord:  # fmt: skip
            return UsageRecord(
                tenant_id=ids[tenant] if tenant else None, model=model, endpoint="/v1/chat/completions",
                prompt_tokens=prompt, completion_tokens=completion, status=status,
                created_at=noon - days_ago * DAY,
            )  # fmt: skip

        session.add_all(
            [
                row("acme", "bot@1", 0, 10, 5),
                row("acme", "bot@1", 0, 20, 7),
                row("acme", "bot@2", 0, 3, 1, status=500),
                row("acme", "bot@2", 2, 30, 9),
                row("acme", "tiny-model", 1, 100, 50),
                row("beta", "bot@1", 1, 11, 4),
                row("beta", "-1+2", 0, 1, 1),  # a formula-looking adapter name
                row(None, '=HYPERLINK("http://x")', 0, 2, 2),
                row(None, "@SUM(1)", 0, 1, 1),
                row("acme", "bot@1", 40, 99, 99),  # outside the default 30 days
            ]
        )
        session.add(
            UsageDaily(
                tenant_id=ids["acme"],
                day=today - 5 * DAY,
                model="bot@1",
                requests=4,
                errors=1,
                prompt_tokens=400,
                completion_tokens=40,
            )
        )
    return ids


def db_sums(env: WebEnv, start: dt.date, end: dt.date) -> dict[tuple[str, str, str], list[int]]:
    """(day, tenant, model) -> [requests, errors, prompt, completion], straight from the tables."""
    since = dt.datetime.combine(start, dt.time(), tzinfo=dt.timezone.utc)
    until = dt.datetime.combine(end + DAY, dt.time(), tzinfo=dt.timezone.utc)

    def read(session: Any) -> dict[tuple[str, str, str], list[int]]:
        names = dict(session.execute(select(Tenant.id, Tenant.name)).tuples().all())
        out: dict[tuple[str, str, str], list[int]] = {}
        for r in session.scalars(
            select(UsageRecord).where(
                UsageRecord.created_at >= since, UsageRecord.created_at < until
            )
        ):
            key = (r.created_at.date().isoformat(), names.get(r.tenant_id, "(operator)"), r.model)
            acc = out.setdefault(key, [0, 0, 0, 0])
            acc[0] += 1
            acc[1] += int(r.status >= 400 and r.status != 499)
            acc[2] += r.prompt_tokens
            acc[3] += r.completion_tokens
        for d in session.scalars(
            select(UsageDaily).where(UsageDaily.day >= start, UsageDaily.day <= end)
        ):
            key = (d.day.isoformat(), names.get(d.tenant_id, "(operator)"), d.model)
            acc = out.setdefault(key, [0, 0, 0, 0])
            for i, v in enumerate((d.requests, d.errors, d.prompt_tokens, d.completion_tokens)):
                acc[i] += v
        return out

    return env.store.db.call(read)


def page_sums(html: str) -> dict[tuple[str, str, str], list[int]]:
    out = {}
    for r in table_rows(html):
        numbers = [
            int(r[k].replace(",", ""))
            for k in ("Requests", "Failed", "Prompt tokens", "Completion tokens")
        ]
        total = int(r["Total tokens"].replace(",", ""))
        assert total == numbers[2] + numbers[3]
        out[(r["Day"], r["Tenant"], r["Model"])] = numbers
    return out


async def test_the_table_adds_up_to_the_database(web: WebEnv, today: dt.date) -> None:
    seed(web, today)
    async with web.http() as http:
        await sign_in(http)
        page = await http.get("/admin/usage")
        assert page.status_code == 200
        expected = db_sums(web, today - 29 * DAY, today)
        assert page_sums(page.text) == expected
        assert len(expected) == 9  # the 40-day-old row is out of range; the roll-up is in
        # newest day first
        days = [r["Day"] for r in table_rows(page.text)]
        assert days == sorted(days, reverse=True)
        # the totals above the table
        requests = sum(v[0] for v in expected.values())
        assert (
            f'<p class="stat-label">Requests</p><p class="stat-value">{requests:,}</p>' in page.text
        )
        # two charts, each a polyline per series, drawn by the server
        assert page.text.count('<figure class="chart">') == 2
        assert page.text.count("<polyline") >= 4
        assert "<script" not in page.text.split("<main", 1)[1]

        # a wider range picks up the old row too
        start = (today - 60 * DAY).isoformat()
        page = await http.get("/admin/usage", params={"start": start, "end": today.isoformat()})
        assert page_sums(page.text) == db_sums(web, today - 60 * DAY, today)


async def test_filters_by_tenant_and_adapter(web: WebEnv, today: dt.date) -> None:
    seed(web, today)
    async with web.http() as http:
        await sign_in(http)
        page = await http.get("/admin/usage", params={"tenant": "acme"})
        sums = page_sums(page.text)
        assert {t for _, t, _ in sums} == {"acme"}
        expected = {
            k: v for k, v in db_sums(web, today - 29 * DAY, today).items() if k[1] == "acme"
        }
        assert sums == expected

        # an adapter's name covers its versions; a model matches exactly
        page = await http.get("/admin/usage", params={"tenant": "acme", "model": "bot"})
        assert {m for _, _, m in page_sums(page.text)} == {"bot@1", "bot@2"}
        page = await http.get("/admin/usage", params={"model": "bot@1"})
        assert {(t, m) for _, t, m in page_sums(page.text)} == {
            ("acme", "bot@1"),
            ("beta", "bot@1"),
        }

        page = await http.get("/admin/usage", params={"model": "nothing-like-it"})
        assert page.status_code == 200 and "No usage in this range." in page.text
        assert "No data yet." in page.text  # the charts say so instead of drawing flat lines


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        ({"tenant": "ghost"}, "f-tenant-help", "There is no tenant named 'ghost'."),
        ({"start": "2024-13-01"}, "f-start-help", "start must be a date as YYYY-MM-DD"),
        ({"start": "2024-02-01", "end": "2024-01-01"}, "f-start-help", "is after end"),
        ({"start": "2020-01-01", "end": "2024-01-01"}, "f-start-help", "more than 366 days"),
    ],
)
async def test_bad_filters_are_marked_inline(
    web: WebEnv, params: dict[str, str], field: str, words: str
) -> None:
    async with web.http() as http:
        await sign_in(http)
        for path in ("/admin/usage", "/admin/usage.csv"):
            page = await http.get(path, params=params)
            assert page.status_code == 400, path
            assert "text/html" in page.headers["content-type"]
            assert words in field_errors(page.text)[field]


async def test_csv_export_has_the_same_rows_and_no_formulas(web: WebEnv, today: dt.date) -> None:
    seed(web, today)
    async with web.http() as http:
        await sign_in(http)
        page = await http.get("/admin/usage", params={"tenant": "beta"})
        assert 'href="/admin/usage.csv?tenant=beta"' in page.text

        r = await http.get("/admin/usage.csv")
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/csv; charset=utf-8"
        start = (today - 29 * DAY).isoformat()
        assert r.headers["content-disposition"] == (
            f'attachment; filename="loraplex-usage_{start}_{today.isoformat()}.csv"'
        )
        assert r.headers["cache-control"] == "no-store"
        rows = list(csv.reader(io.StringIO(r.text)))
        assert rows[0] == list(usage_page.CSV_HEADER)
        body = rows[1:]
        assert [b[0] for b in body] == sorted(b[0] for b in body)  # oldest day first

        def unquote(cell: str) -> str:
            return cell[1:] if cell.startswith("'") else cell

        got = {(d, unquote(t), unquote(m)): [int(x) for x in nums[:4]] for d, t, m, *nums in body}
        assert got == db_sums(web, today - 29 * DAY, today)
        # formula-looking cells are text: quoted, and nothing else is
        for cell in (c for b in body for c in b):
            assert not cell.startswith(("=", "+", "-", "@")), cell
        models = {b[2] for b in body}
        assert {'\'=HYPERLINK("http://x")', "'@SUM(1)", "'-1+2"} <= models
        assert "bot@1" in models

        r = await http.get("/admin/usage.csv", params={"tenant": "acme", "model": "bot@1"})
        assert r.headers["content-disposition"].endswith(f'_{today.isoformat()}_acme_bot_1.csv"')
        filtered = list(csv.reader(io.StringIO(r.text)))[1:]
        assert filtered and all(row[1:3] == ["acme", "bot@1"] for row in filtered)


def test_csv_cells_are_never_formulas() -> None:
    for value in ("=1+1", "+1", "-1", "@A1", "\t=1", "\r=1"):
        assert usage_page.csv_cell(value) == "'" + value
    for value in ("bot@1", "acme", "1,5", 12):
        assert usage_page.csv_cell(value) == str(value)


async def test_a_deleted_tenants_usage_goes_with_it(web: WebEnv, today: dt.date) -> None:
    """Rows of a tenant deleted since are gone with it; the operator's rows stay."""
    ids = seed(web, today)
    with web.store.db.session() as session:
        tenants.delete_tenant(session, "admin", session.get(Tenant, ids["beta"]))
    async with web.http() as http:
        await sign_in(http)
        sums = page_sums((await http.get("/admin/usage")).text)
    assert {t for _, t, _ in sums} == {"acme", "(operator)"}
    count = web.store.db.call(lambda s: s.scalar(select(func.count()).select_from(UsageRecord)))
    assert count == 8  # beta's two rows went with it
