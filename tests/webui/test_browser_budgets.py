"""Budgets in headless Chromium (issue 34.1): a tenant's budget and a key's added through the
budgets page's form, each shown with used / limit / a bar / resets at on the budgets page, the
tenant's page and the key's page. Screenshots at desktop and phone width
(``screenshots/webui/``), each checked for horizontal overflow."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from loraplex.platform import tenants as service
from loraplex.platform.db.models import ApiKey, UsageRecord, utcnow
from tests.utils import browser as base
from tests.utils.server import ServerThread
from tests.utils.web import ADMIN_TOKEN, WebEnv

pytestmark = base.needs_chromium
expect = base.expect
browser = base.browser
shot = base.shot


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WebEnv, str, str]]:
    """The admin UI over HTTP, tenant acme with a key that used 1,300 tokens today."""
    env = WebEnv.build(tmp_path)
    env.tenant_key("acme")
    with env.store.db.session() as session:
        tenant = service.get_tenant(session, "acme")
        assert tenant is not None
        key = session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id)).one()
        for tokens in (600, 700):
            session.add(
                UsageRecord(
                    tenant_id=tenant.id, api_key_id=key.id, model="tiny-model",
                    prompt_tokens=tokens // 2, completion_tokens=tokens - tokens // 2,
                    status=200, created_at=utcnow(),
                )
            )  # fmt: skip
        public_id = key.public_id
    try:
        with ServerThread(env.app) as server:
            yield env, server.url, public_id
    finally:
        env.close()


def _add(page: Any, *, applies_to: str, period: str, kind: str, limit: str, soft: str) -> None:
    page.get_by_label("Applies to").select_option(label=applies_to)
    page.get_by_label("Window", exact=True).select_option(period)
    page.get_by_label("Window kind").select_option(kind)
    page.locator("#f-limit").fill(limit)  # labelled "Limit *" (required)
    page.get_by_label("Soft limit (%)").fill(soft)
    page.get_by_role("button", name="Add budget").click()


def test_budgets_in_the_browser(browser: Any, served: tuple[WebEnv, str, str], shot: Any) -> None:
    _, url, public_id = served
    midnight = (utcnow() + dt.timedelta(days=1)).strftime("%Y-%m-%d") + " 00:00 UTC"
    page = browser.new_context(viewport=base.DESKTOP).new_page()
    page.set_default_timeout(10_000)
    page.goto(url + "/admin/tenants/acme/budgets")
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Budgets of acme")).to_be_visible()
    expect(page.get_by_text("No budgets: requests are limited only by the quotas.")).to_be_visible()

    _add(page, applies_to="The whole tenant", period="day", kind="calendar", limit="0", soft="")
    expect(page.locator("#f-limit-help")).to_contain_text("limit must be above 0")
    shot(page, "budgets-form-error")
    _add(page, applies_to="The whole tenant", period="day", kind="calendar", limit="2000",
         soft="50")  # fmt: skip
    expect(page.get_by_text("Budget added: it applies from the next request.")).to_be_visible()
    row = page.locator("tr[data-budget]").first
    expect(row).to_contain_text("Tokens, daily (calendar, UTC)")
    expect(row.locator(".budget-used")).to_have_text("1,300 tokens")
    expect(row.locator(".budget-limit")).to_have_text("2,000 tokens")
    expect(row.locator(".budget-resets")).to_have_text(midnight)
    expect(row.locator("meter")).to_have_attribute("value", "0.65")
    expect(row).to_contain_text("65 % · past the soft limit")

    _add(page, applies_to=f"Key {public_id}", period="month", kind="rolling", limit="1000",
         soft="")  # fmt: skip
    key_row = page.locator("tr[data-budget][data-state=exceeded]")
    expect(key_row).to_contain_text("spent: requests refused")
    shot(page, "budgets")

    page.goto(url + "/admin/keys")
    page.get_by_role("link", name=re.compile(r"^Budgets of lpx_")).click()
    expect(page).to_have_url(re.compile(rf"/admin/keys/{public_id}/budgets$"))
    expect(page.locator("tr[data-budget]")).to_have_count(2)

    page.goto(url + "/admin/tenants/acme")
    section = page.locator("section", has=page.get_by_role("heading", name="Budgets"))
    expect(section.locator("tr[data-budget]")).to_have_count(2)
    expect(section.locator(".budget-used").first).to_have_text("1,300 tokens")
    shot(page, "tenant-budgets")
    section.get_by_role("link", name=f"Key {public_id}").click()
    expect(page).to_have_url(re.compile(rf"/admin/keys/{public_id}/budgets$"))
    expect(page.locator("tr[data-budget]")).to_have_count(2)
    expect(page.locator("tr[data-state=exceeded]")).to_contain_text("1,000 tokens")
    shot(page, "key-budgets")
