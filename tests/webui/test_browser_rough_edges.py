"""Console rough edges of issue 35 (point 4), measured in headless Chromium at 1400 px wide:
the new-tenant form keeps a two-column row level when one field has an error, and the audit
table fits its box (short timestamps; long hashes and names shown whole or cut with an ellipsis,
the whole value in a ``title``). Each test failed before its fix; see the commit messages.
"""

from __future__ import annotations

import datetime as dt
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert

from loraplex.platform.db.models import AuditEvent
from tests.utils import browser as base
from tests.utils.server import ServerThread
from tests.utils.web import ADMIN_TOKEN, WebEnv

pytestmark = base.needs_chromium
expect = base.expect
WIDE = {"width": 1400, "height": 900}  # the screens of issue 35

# The browser and the screenshot helper every browser test shares.
browser = base.browser
shot = base.shot

LONG_TENANT = "customer-support-eu-west-production-" + "x" * 27  # 63 characters, the most
LONG_ACTOR = f"tenant:{LONG_TENANT}/key:a1b2c3d4e5f6"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WebEnv, str]]:
    env = WebEnv.build(tmp_path)
    try:
        with ServerThread(env.app) as server:
            yield env, server.url
    finally:
        env.close()


def signed_in(browser: Any, url: str, path: str) -> Any:
    page = browser.new_page(viewport=WIDE)
    page.set_default_timeout(10_000)
    page.goto(url + path)
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(re.compile(re.escape(path) + "$"))
    return page


def box(page: Any, selector: str) -> dict[str, float]:
    found = page.locator(selector).bounding_box()
    assert found is not None, selector
    return dict(found)


def test_an_error_in_a_two_column_row_keeps_its_neighbour_level(
    browser: Any, served: tuple[WebEnv, str], shot: base.Shot
) -> None:
    _, url = served
    page = signed_in(browser, url, "/admin/tenants/-/new")
    page.locator("#f-name").fill("acme")
    page.get_by_label("Requests per minute").fill("99999999999999")  # over 10^12: the server's
    page.get_by_role("button", name="Create tenant").click()
    expect(page.locator("#f-requests_per_minute-help")).to_contain_text("whole number")
    errored, neighbour = box(page, "#f-requests_per_minute"), box(page, "#f-tokens_per_minute")
    label = box(page, "label[for=f-tokens_per_minute]")
    assert abs(neighbour["y"] - errored["y"]) <= 1, (errored, neighbour)
    assert abs(neighbour["height"] - errored["height"]) <= 1, (errored, neighbour)
    gap = neighbour["y"] - (label["y"] + label["height"])
    assert 0 <= gap <= 8, f"the label sits {gap}px above its input"  # the field's row gap
    shot(page, "tenant-new-row-error")
    page.close()


def test_one_submit_reports_every_bad_field(browser: Any, served: tuple[WebEnv, str]) -> None:
    """Validation in stages (issue 35): the browser's own checks stopped at the first bad
    field (a bubble), and the name was only checked after the others; one submit now shows
    every field's error inline."""
    _, url = served
    page = signed_in(browser, url, "/admin/tenants/-/new")
    page.locator("#f-name").fill("Acme Corp")
    page.get_by_label("Requests per minute").fill("-5")
    page.get_by_label("Weight").fill("0")
    page.get_by_role("button", name="Create tenant").click()
    for field, text in (("name", "1-63 characters"), ("requests_per_minute", "whole number"),
                        ("weight", "from 0.01 to 100")):  # fmt: skip
        expect(page.locator(f"#f-{field}-help.field-error")).to_contain_text(text)
    expect(page.locator(".field-error")).to_have_count(3)
    page.close()


def seed_audit(env: WebEnv) -> str:
    """Upload and update events with long names and a content hash; returns the hash."""
    sha = secrets.token_hex(32)
    now = dt.datetime.now(dt.timezone.utc)
    version = {"adapter": "support-bot-multilingual", "description": "", "number": 12,
               "content_sha256": sha, "rank": 16, "alpha": 32.0, "size_bytes": 4_718_592,
               "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                  "up_proj", "down_proj"], "status": "ready"}  # fmt: skip
    rows = [
        {"created_at": now, "actor": LONG_ACTOR, "tenant_name": LONG_TENANT,
         "action": "adapter.upload", "object_type": "adapter_version",
         "object_id": "support-bot-multilingual@12", "after": version},
        {"created_at": now, "actor": "admin (web)", "tenant_name": "acme",
         "action": "budget.soft_limit_crossed", "object_type": "tenant", "object_id": "acme",
         "before": {"requests_per_minute": None, "status": "active"},
         "after": {"requests_per_minute": 600, "status": "suspended"}},
    ]  # fmt: skip
    with env.store.db.session() as session:
        session.execute(insert(AuditEvent), rows)
    return sha


# Every element inside a cell that is wider than it shows must end in an ellipsis and carry
# its whole text in a title; no cell may spill into the next.
CUT_WITHOUT_TITLE = """(table) => {
  const bad = [];
  for (const td of table.querySelectorAll("td")) {
    if (td.scrollWidth > td.clientWidth + 1) bad.push("cell spills: " + td.textContent.trim());
    for (const el of td.querySelectorAll("*")) {
      if (el.scrollWidth <= el.clientWidth + 1 || el.clientWidth === 0) continue;
      const cut = getComputedStyle(el).textOverflow === "ellipsis";
      if (!cut || el.title !== el.textContent.trim()) bad.push("cut: " + el.textContent.trim());
    }
  }
  return bad;
}"""


def test_the_audit_table_fits_its_box(
    browser: Any, served: tuple[WebEnv, str], shot: base.Shot
) -> None:
    env, url = served
    sha = seed_audit(env)
    page = signed_in(browser, url, "/admin/audit")
    table = page.locator("table.table")
    wrap = page.locator(".table-wrap")
    assert wrap.evaluate("w => w.scrollWidth - w.clientWidth") <= 0, "the table scrolls"
    assert box(page, "table.table")["width"] <= box(page, ".table-wrap")["width"]
    for time in page.locator("td time").all():
        lines = time.evaluate(
            "t => t.getBoundingClientRect().height / parseFloat(getComputedStyle(t).lineHeight)"
        )
        assert lines <= 2.05, f"a timestamp takes {lines:.1f} lines"
    assert table.evaluate(CUT_WITHOUT_TITLE) == []
    # The hash, the long tenant and the actor: whole on the page or in a title.
    for value in (sha, LONG_TENANT, LONG_ACTOR):
        holder = page.locator(f'td [title="{value}"]')
        if holder.count() == 0:
            assert page.get_by_text(value, exact=True).first.is_visible(), value
            continue
        assert holder.first.evaluate("e => e.textContent.trim()") == value
    shot(page, "audit-long-values")  # also phone width: no horizontal overflow
    page.close()


def test_the_top_bar_keeps_sign_out_on_the_first_line(
    browser: Any, served: tuple[WebEnv, str], shot: base.Shot
) -> None:
    """Every navigation item and Sign out fit one bar at 1400 px: the navigation wraps inside
    its own box (at narrower widths) instead of pushing Sign out under the brand."""
    _, url = served
    page = signed_in(browser, url, "/admin")
    brand, sign_out = box(page, ".brand"), box(page, ".signout button")
    centre = brand["y"] + brand["height"] / 2
    assert sign_out["y"] <= centre <= sign_out["y"] + sign_out["height"], (brand, sign_out)
    for width in (1400, 1100, 900):  # narrower: the navigation may take two lines, Sign out stays
        page.set_viewport_size({"width": width, "height": 900})
        brand, sign_out = box(page, ".brand"), box(page, ".signout button")
        assert sign_out["y"] < brand["y"] + brand["height"], (width, brand, sign_out)
    shot(page, "top-bar-900")
    page.close()
