"""The Audit log page: events with a readable diff, filters, keyset pages, escaping."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from sqlalchemy import insert

from loraplex.platform.db.models import AuditEvent
from loraplex.webui.audit import Change, changes
from tests.utils.web import WebEnv, post_form, sign_in

pytestmark = pytest.mark.anyio

ROW = re.compile(r'<code class="action[^"]*"[^>]*>([^<]+)</code>')


def actions(html: str) -> list[str]:
    return ROW.findall(html)


def add_events(web: WebEnv, specs: list[tuple[str, str, str, dt.datetime]]) -> None:
    """(action, tenant, actor, when) rows, oldest first."""
    rows = [
        {"created_at": when, "actor": actor, "tenant_name": tenant, "action": action,
         "object_type": "tenant", "object_id": tenant}
        for action, tenant, actor, when in specs
    ]  # fmt: skip
    with web.store.db.session() as session:
        session.execute(insert(AuditEvent), rows)


def test_changes_show_what_differs() -> None:
    before = {"name": "acme", "status": "active", "requests_per_minute": None, "scopes": ["a"]}
    after = {"name": "acme", "status": "suspended", "requests_per_minute": 60, "scopes": ["a"]}
    assert changes(before, after) == [
        Change("status", "active", "suspended"),
        Change("requests_per_minute", "no limit", "60"),
    ]
    created = {"name": "k", "public_id": "abc", "scopes": ["inference", "adapters:write"],
               "expires_at": "2030-01-02T03:04:05+00:00", "revoked_at": None}  # fmt: skip
    assert changes(None, created, "abc") == [
        Change("name", None, "k"),
        Change("scopes", None, "inference, adapters:write"),
        Change("expires_at", None, "2030-01-02 03:04 UTC"),
    ]
    assert changes({"name": "acme", "display_name": ""}, None, "acme") == []
    assert changes(None, None) == []


async def test_the_log_shows_changes_made_in_the_ui(web: WebEnv) -> None:
    async with web.http() as http:
        await sign_in(http)
        await post_form(http, "/admin/tenants/-/new", "/admin/tenants",
                        {"name": "acme", "display_name": "<b>Acme</b>"})  # fmt: skip
        await post_form(http, "/admin/tenants/acme/edit", "/admin/tenants/acme/edit",
                        {"display_name": "<b>Acme</b>", "requests_per_minute": "120"})  # fmt: skip
        await post_form(http, "/admin/tenants/acme", "/admin/tenants/acme/status",
                        {"status": "suspended"})  # fmt: skip
        page = await http.get("/admin/audit")
        assert page.status_code == 200
        assert actions(page.text) == ["tenant.suspend", "tenant.update", "tenant.create"]
        html = re.sub(r"\s+", " ", page.text)
        assert ('<span class="diff-field">requests_per_minute</span> <del class="clip" '
                'title="no limit">no limit</del> <span class="diff-arrow">→</span> '
                '<ins class="clip" title="120">120</ins>') in html  # fmt: skip
        assert '>active</del> <span class="diff-arrow">→</span> <ins' in html
        escaped = "&lt;b&gt;Acme&lt;/b&gt;"
        assert f'<ins class="clip" title="{escaped}">{escaped}</ins>' in html
        assert "<b>Acme</b>" not in html
        actor = '<td data-label="Actor"><span class="clip-2" title="admin (web)">admin (web)</span>'
        assert html.count(actor) == 3
        assert "Clear filters" not in html and "Older »" not in html


async def test_filters(web: WebEnv) -> None:
    day = dt.datetime(2025, 3, 10, 12, tzinfo=dt.timezone.utc)
    add_events(web, [
        ("tenant.create", "acme", "admin", day - dt.timedelta(days=2)),
        ("key.create", "acme", "admin (web)", day - dt.timedelta(days=1)),
        ("key.revoke", "beta", "admin (web)", day),
        ("adapter.upload", "acme", "tenant:acme/key:abc", day + dt.timedelta(hours=11)),
        ("tenant.update", "beta", "admin", day + dt.timedelta(days=1)),
    ])  # fmt: skip
    async with web.http() as http:
        await sign_in(http)

        async def shown(**params: str) -> list[str]:
            page = await http.get("/admin/audit", params=params)
            assert page.status_code == 200, page.text
            return actions(page.text)

        assert await shown(tenant="acme") == ["adapter.upload", "key.create", "tenant.create"]
        assert await shown(action="key.") == ["key.revoke", "key.create"]
        assert await shown(action="key.*") == ["key.revoke", "key.create"]
        assert await shown(action="key") == []  # exact unless it ends with a dot
        assert await shown(action="tenant.update") == ["tenant.update"]
        assert await shown(actor="admin (web)") == ["key.revoke", "key.create"]
        # "until" includes its whole day
        within = await shown(since="2025-03-10", until="2025-03-10")
        assert within == ["adapter.upload", "key.revoke"]
        assert await shown(since="2025-03-11") == ["tenant.update"]
        assert await shown(tenant="acme", action="key.") == ["key.create"]
        assert await shown(tenant="nobody") == []
        page = await http.get("/admin/audit", params={"tenant": "acme"})
        assert 'value="acme"' in page.text and "Clear filters" in page.text

        bad = await http.get("/admin/audit", params={"since": "10/03/2025", "until": "2025-13-01"})
        assert bad.status_code == 400
        assert bad.text.count("Enter a date as YYYY-MM-DD") == 2 and actions(bad.text) == []
        swapped = await http.get(
            "/admin/audit", params={"since": "2025-03-11", "until": "2025-03-10"}
        )
        assert swapped.status_code == 400 and "swap them" in swapped.text
        broken = await http.get("/admin/audit", params={"before": "x"})
        assert broken.status_code == 400 and "That page link is broken" in broken.text
        assert len(actions(broken.text)) == 5


async def test_older_pages_follow_the_last_id_and_keep_the_filters(web: WebEnv) -> None:
    start = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    add_events(web, [
        (f"tenant.update{'' if i % 2 else '.x'}", "acme" if i % 2 else "beta", "admin",
         start + dt.timedelta(minutes=i))
        for i in range(250)
    ])  # fmt: skip
    async with web.http() as http:
        await sign_in(http)
        seen: list[int] = []
        url: str | None = "/admin/audit?tenant=acme"
        pages = 0
        while url is not None:
            page = await http.get(url)
            pages += 1
            seen += [
                60 * int(h) + int(m)
                for h, m in re.findall(r'<time datetime="2025-01-01T(\d\d):(\d\d)', page.text)
            ]
            older = re.search(r'href="([^"]+)" rel="next">Older', page.text)
            url = older.group(1).replace("&amp;", "&") if older else None
            if url:
                assert "tenant=acme" in url and "before=" in url
            if pages > 1:
                assert "« Newest" in page.text
        assert pages == 3  # 125 events of acme: 50 + 50 + 25
        assert seen == sorted(range(1, 250, 2), reverse=True)
