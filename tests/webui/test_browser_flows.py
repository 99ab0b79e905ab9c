"""The tenant, key and audit pages in headless Chromium: sign in, create a tenant (after an
inline error), create a key (shown once, copied with the copy button), use it, revoke it (the
API refuses it on the next request), read the audit log; screenshots of each page at desktop and
phone width (``screenshots/webui/``), each checked for horizontal overflow by ``shot``. A second
test runs the same flow with JavaScript off.
"""

from __future__ import annotations

import datetime as dt
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import insert

from loraplex.platform import tenants as service
from loraplex.platform.db.models import Adapter, AdapterVersion, Tenant, UsageRecord, utcnow
from loraplex.platform.db.scope import TenantScope
from tests.utils import browser as base
from tests.utils.server import ServerThread
from tests.utils.tenancy import bearer
from tests.utils.web import ADMIN_TOKEN, WebEnv

pytestmark = base.needs_chromium
expect = base.expect
DESKTOP = base.DESKTOP

# The browser and the screenshot helper every browser test shares.
browser = base.browser
shot = base.shot

KEY = re.compile(r"lpx_[a-z0-9]{12}_[A-Za-z0-9]{32}")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WebEnv, str]]:
    env = WebEnv.build(tmp_path)
    try:
        with ServerThread(env.app) as server:
            yield env, server.url
    finally:
        env.close()


def seed_neighbours(env: WebEnv) -> None:
    """Other tenants for the list (one with a script for a display name)."""
    now = utcnow()
    rows = [
        {"name": f"customer-{i:03d}", "display_name": f"Customer {i}", "cache_salt": "s" * 32,
         "status": "suspended" if i % 7 == 3 else "active", "created_at": now, "updated_at": now,
         "requests_per_minute": 600 if i % 3 else None, "tokens_per_minute": 100_000}
        for i in range(80)
    ]  # fmt: skip
    with env.store.db.session() as session:
        session.execute(insert(Tenant), rows)
        service.create_tenant(session, "admin", "evil", display_name="<script>alert(1)</script>")


def seed_adapters_and_usage(env: WebEnv, name: str) -> None:
    """Two adapter versions and a few days of requests for ``name``'s page."""
    now = utcnow()
    with env.store.db.session() as session:
        tenant = service.require_tenant(session, name)
        scope = TenantScope(session, tenant.id)
        adapter = scope.add(Adapter(name="support-bot", description="", next_version=3))
        session.flush()
        for number, status in ((1, "ready"), (2, "ready")):
            session.add(
                AdapterVersion(
                    adapter_id=adapter.id, number=number, content_sha256=secrets.token_hex(32),
                    rank=16, alpha=32.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                    size_bytes=4_718_592 * number, status=status,
                )
            )  # fmt: skip
        for day in range(5):
            for i in range(3 + day):
                scope.add(
                    UsageRecord(
                        model="support-bot@2" if i % 2 else "SmolLM2-135M-Instruct",
                        prompt_tokens=120 + i, completion_tokens=64, latency_ms=300.0,
                        status=200 if i != 4 else 429,
                        created_at=now - dt.timedelta(days=day, minutes=i),
                    )
                )  # fmt: skip


def console_errors(page: Any) -> list[str]:
    errors: list[str] = []
    page.on(
        "console",
        lambda m: (
            errors.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.on("pageerror", lambda e: errors.append(str(e)))
    return errors


def api_status(url: str, token: str) -> int:
    return httpx.get(url + "/v1/models", headers=bearer(token), timeout=10).status_code


def test_tenant_key_and_audit_flow(browser: Any, served: tuple[WebEnv, str], shot: Any) -> None:
    env, url = served
    context = browser.new_context(
        viewport=DESKTOP, permissions=["clipboard-read", "clipboard-write"]
    )
    context.set_default_timeout(10_000)
    page = context.new_page()
    errors = console_errors(page)

    # Sign in on the way to the Tenants page.
    page.goto(url + "/admin/tenants")
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(re.compile(r"/admin/tenants$"))
    expect(page.locator("nav a[aria-current=page]")).to_have_text("Tenants")
    expect(page.get_by_text("No tenants yet")).to_be_visible()

    # Create a tenant: a bad name first, shown inline, then a good one.
    page.get_by_role("link", name="New tenant").click()
    expect(page.get_by_role("heading", name="New tenant")).to_be_visible()
    page.locator("#f-name").fill("Acme Corp")
    page.get_by_label("Display name").fill("Acme Corporation")
    page.get_by_label("Requests per minute").fill("600")
    page.get_by_label("Tokens per minute").fill("200000")
    page.get_by_role("button", name="Create tenant").click()
    expect(page.locator("#f-name-help")).to_contain_text("A tenant name is 1-63 characters")
    expect(page.get_by_label("Display name")).to_have_value("Acme Corporation")
    shot(page, "tenant-new-error")
    page.locator("#f-name").fill("acme-corp")
    page.get_by_label("Adapters").fill("20")
    page.get_by_role("button", name="Create tenant").click()
    expect(page).to_have_url(re.compile(r"/admin/tenants/acme-corp$"))
    expect(page.get_by_role("heading", name="Acme Corporation")).to_be_visible()
    expect(page.get_by_text("Tenant acme-corp created.")).to_be_visible()

    # Its page, with adapters and usage to show.
    seed_adapters_and_usage(env, "acme-corp")
    seed_neighbours(env)
    page.reload()
    expect(page.locator("code", has_text="support-bot@2")).to_be_visible()

    # A key: created, shown once, copied with the button.
    page.get_by_role("link", name="New key").click()
    expect(page.locator("#f-tenant")).to_have_value("acme-corp")
    page.get_by_label("Key name").fill("production")
    page.get_by_label("adapters:write — upload and delete adapters").uncheck()
    page.get_by_label("Expires after (days)").fill("90")
    shot(page, "key-new")
    page.get_by_role("button", name="Create key").click()
    expect(page.get_by_role("heading", name="Copy the key now")).to_be_visible()
    token = page.locator("#new-key").inner_text().strip()
    assert KEY.fullmatch(token), token
    copy = page.locator("button[data-copy=new-key]")
    expect(copy).to_have_text("Copy key")
    expect(copy).to_be_visible()  # admin.js reveals it where the clipboard API exists
    copy.click()
    expect(copy).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == token
    shot(page, "key-created")
    page.reload()
    expect(page.get_by_role("heading", name="The key was shown once")).to_be_visible()
    assert token not in page.content()
    shot(page, "key-created-again")

    assert api_status(url, token) == 200
    page.get_by_role("link", name="Done").click()
    expect(page.locator("code.key")).to_have_count(1)
    expect(page.get_by_text("inference", exact=True)).to_be_visible()
    shot(page, "tenant")

    # Revoke it (after the confirmation page): the API refuses the key on the next request.
    page.get_by_role("link", name=re.compile(r"^Revoke lpx_")).click()
    expect(page.get_by_role("heading", name="Revoke this key?")).to_be_visible()
    shot(page, "key-revoke")
    page.get_by_role("button", name="Revoke key").click()
    expect(page).to_have_url(re.compile(r"/admin/tenants/acme-corp$"))
    expect(page.get_by_text("revoked: it is refused from its next request")).to_be_visible()
    assert api_status(url, token) == 401

    # Edit quotas; suspend and resume.
    page.get_by_role("link", name="Edit", exact=True).click()
    expect(page.get_by_label("Requests per minute")).to_have_value("600")
    shot(page, "tenant-edit")
    page.get_by_label("Concurrent requests").fill("8")
    page.get_by_role("button", name="Save").click()
    expect(page.get_by_text("Saved.")).to_be_visible()
    page.get_by_role("button", name="Suspend").click()
    expect(page.get_by_text("Every request with this tenant's keys is refused")).to_be_visible()
    shot(page, "tenant-suspended")
    page.get_by_role("button", name="Resume").click()
    expect(page.get_by_text("acme-corp is active again")).to_be_visible()

    # The lists.
    page.get_by_role("link", name="Keys", exact=True).click()
    expect(page.get_by_role("heading", name="API keys")).to_be_visible()
    shot(page, "keys")
    page.get_by_role("link", name="Tenants", exact=True).click()
    expect(page.get_by_text("82 tenants")).to_be_visible()
    shot(page, "tenants")
    page.get_by_label("Search tenants").fill("customer 1")
    page.get_by_role("button", name="Search").click()
    expect(page.get_by_text("11 tenants match")).to_be_visible()
    shot(page, "tenants-search")
    page.goto(url + "/admin/tenants?page=2")
    expect(page.get_by_text("Page 2 of 2")).to_be_visible()
    expect(page.get_by_text("<script>alert(1)</script>")).to_be_visible()  # text, not a script

    # Delete a tenant, through its confirmation page.
    page.goto(url + "/admin/tenants/customer-001")
    page.get_by_role("link", name="Delete…").click()
    page.locator("#f-confirm").fill("customer-01")
    page.get_by_role("button", name="Delete this tenant").click()
    expect(page.locator("#f-confirm-help")).to_contain_text("exactly to confirm")
    shot(page, "tenant-delete")
    page.locator("#f-confirm").fill("customer-001")
    page.get_by_role("button", name="Delete this tenant").click()
    expect(page.get_by_text("Tenant customer-001 deleted")).to_be_visible()

    # The audit log tells the story, newest first.
    page.get_by_role("link", name="Audit log", exact=True).click()
    actions = page.locator("code.action").all_inner_texts()
    assert actions[:7] == [
        "tenant.delete", "tenant.resume", "tenant.suspend", "tenant.update", "key.revoke",
        "key.create", "tenant.create",
    ], actions  # fmt: skip
    expect(page.locator("del", has_text="active").first).to_be_visible()
    shot(page, "audit")
    page.get_by_label("Action").fill("key.")
    page.get_by_label("Tenant").fill("acme-corp")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("code.action")).to_have_text(["key.revoke", "key.create"])
    shot(page, "audit-filtered")
    assert errors == [], errors
    context.close()


def test_the_flow_works_without_javascript(browser: Any, served: tuple[WebEnv, str]) -> None:
    _, url = served
    context = browser.new_context(java_script_enabled=False, viewport=base.PHONE)
    context.set_default_timeout(10_000)
    page = context.new_page()
    page.goto(url + "/admin/tenants/-/new")
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    page.locator("#f-name").fill("acme")
    page.get_by_role("button", name="Create tenant").click()
    page.get_by_role("link", name="New key").click()
    page.get_by_role("button", name="Create key").click()
    token = page.locator("#new-key").inner_text().strip()
    assert KEY.fullmatch(token)
    expect(page.get_by_role("button", name="Copy key")).to_be_hidden()  # needs the script
    assert api_status(url, token) == 200
    page.get_by_role("link", name="Done").click()
    page.get_by_role("link", name=re.compile(r"^Revoke lpx_")).click()
    page.get_by_role("button", name="Revoke key").click()
    expect(page.get_by_text("revoked: it is refused from its next request")).to_be_visible()
    assert api_status(url, token) == 401
    page.get_by_role("link", name="Audit log", exact=True).click()
    expect(page.locator("code.action")).to_have_text(["key.revoke", "key.create", "tenant.create"])
    context.close()
