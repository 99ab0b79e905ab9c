"""The budget pages: a budget added through the form shows on the tenant's page, its budgets page
and its key's page with used / limit / resets at and a bar; a bad form comes back with the
message inline; removing one; the audit log names the admin UI."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from sqlalchemy import select

from loraplex.platform import tenants as service
from loraplex.platform.db.models import ApiKey, AuditEvent, UsageRecord, utcnow
from loraplex.webui.views import WEB_ACTOR
from tests.utils.web import WebEnv, post_form, sign_in

pytestmark = pytest.mark.anyio


def _spend(web: WebEnv, tenant: str, tokens: list[int]) -> str:
    """Usage rows of ``tenant``'s key (one per request, as the usage recorder writes them);
    returns the key's public id."""
    web.tenant_key(tenant)
    with web.store.db.session() as session:
        row = service.get_tenant(session, tenant)
        assert row is not None
        key = session.scalars(select(ApiKey).where(ApiKey.tenant_id == row.id)).first()
        assert key is not None
        for n in tokens:
            session.add(
                UsageRecord(
                    tenant_id=row.id, api_key_id=key.id, model="tiny-chat", prompt_tokens=n // 2,
                    completion_tokens=n - n // 2, status=200, created_at=utcnow(),
                )
            )  # fmt: skip
        return key.public_id


def _row(html: str) -> str:
    match = re.search(r'<tr data-budget="\d+" data-state="\w+">.*?</tr>', html, re.S)
    assert match, "no budget row on the page"
    return match.group(0)


async def test_a_budget_added_in_the_form_shows_used_limit_and_reset(web: WebEnv) -> None:
    public_id = _spend(web, "acme", [600, 700])
    midnight = (utcnow() + dt.timedelta(days=1)).strftime("%Y-%m-%d") + " 00:00 UTC"
    async with web.http() as http:
        await sign_in(http)
        page = "/admin/tenants/acme/budgets"
        added = await post_form(
            http, page, page,
            {"scope": "", "metric": "tokens", "period": "day", "anchor": "calendar",
             "limit": "2000", "soft_percent": "50", "prompt_weight": "1",
             "completion_weight": "1"},
        )  # fmt: skip
        assert added.status_code == 303, added.text
        for path in ("/admin/tenants/acme", page, f"/admin/keys/{public_id}/budgets"):
            html = (await http.get(path)).text
            row = _row(html)
            assert 'data-state="soft"' in row  # 1,300 of 2,000: past the 50 % soft limit
            assert "Tokens, daily (calendar, UTC)" in row
            assert '<td data-label="Used" class="num budget-used">1,300 tokens</td>' in row
            assert '<td data-label="Limit" class="num budget-limit">2,000 tokens</td>' in row
            assert re.search(r'<meter class="meter"[^>]* value="0.65"', row)
            assert "65 %" in row and midnight in row

        # A key budget: listed for that key, spent already.
        added = await post_form(
            http, page, page,
            {"scope": public_id, "metric": "tokens", "period": "month", "anchor": "rolling",
             "limit": "1000", "soft_percent": "", "prompt_weight": "1",
             "completion_weight": "1"},
        )  # fmt: skip
        assert added.status_code == 303, added.text
        html = (await http.get(f"/admin/keys/{public_id}/budgets")).text
        assert html.count("<tr data-budget=") == 2
        assert 'data-state="exceeded"' in html and "spent: requests refused" in html
        assert "Tokens, monthly (rolling)" in html

        # Removing the tenant's budget.
        budgets = (await http.get(page)).text
        first = re.search(r'action="(/admin/tenants/acme/budgets/(\d+)/delete)"', budgets)
        assert first
        removed = await http.post(
            first.group(1), data={"csrf_token": _csrf(budgets)}, follow_redirects=True
        )
        assert "Budget removed." in removed.text
        assert removed.text.count("<tr data-budget=") == 1
    with web.store.db.session() as session:
        actions = [
            (e.action, e.actor)
            for e in session.scalars(select(AuditEvent).where(AuditEvent.action.like("budget.%")))
        ]
    assert actions == [("budget.create", WEB_ACTOR)] * 2 + [("budget.delete", WEB_ACTOR)]


def _csrf(html: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert match
    return match.group(1)


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"limit": "0"}, "limit", "limit must be above 0"),
        ({"limit": "lots"}, "limit", "is not a number"),
        ({"soft_percent": "150"}, "soft_percent", "soft_percent must be a percentage"),
        ({"metric": "requests"}, "metric", "metric must be one of tokens, cost"),
        ({"scope": "nokey"}, "scope", "has no API key &#39;nokey&#39;"),
    ],
)
async def test_a_bad_budget_form_comes_back_with_the_message_inline(
    web: WebEnv, fields: dict[str, str], field: str, message: str
) -> None:
    web.tenant_key("acme")
    async with web.http() as http:
        await sign_in(http)
        page = "/admin/tenants/acme/budgets"
        data = {"scope": "", "metric": "tokens", "period": "day", "anchor": "calendar",
                "limit": "10", "soft_percent": "", "prompt_weight": "1",
                "completion_weight": "1", **fields}  # fmt: skip
        response = await post_form(http, page, page, data)
        assert response.status_code == 400
        help_text = re.search(
            rf'<p class="field-error" id="f-{field}-help">([^<]*)</p>', response.text
        )
        assert help_text and message in help_text.group(1), response.text[-3000:]
        assert "No budgets" in response.text
