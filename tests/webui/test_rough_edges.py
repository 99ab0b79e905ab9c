"""Console rough edges of issue 35 (point 4) that need no browser: a signed-in operator's error
pages keep the navigation, and the engine's adapter tiers have the same words on every page.
The layout ones are in ``test_browser_rough_edges.py``."""

from __future__ import annotations

import re

import pytest

from tests.utils.web import WebEnv, sign_in

pytestmark = pytest.mark.anyio

NAV_LINK = re.compile(r'<nav class="nav" aria-label="Main">.*?</nav>', re.S)


def nav_labels(html: str) -> list[str]:
    nav = NAV_LINK.search(html)
    return re.findall(r"<a [^>]*>([^<]+)</a>", nav.group(0)) if nav else []


async def test_a_404_page_keeps_the_navigation_when_signed_in(web: WebEnv) -> None:
    unknown = ("/admin/nope", "/admin/tenants/acme/nothing/here")
    async with web.http() as http:
        for path in unknown:  # signed out: no admin navigation, no sign-out form
            page = await http.get(path)
            assert page.status_code == 404 and nav_labels(page.text) == [], path
            assert "/admin/logout" not in page.text
        await sign_in(http)
        overview = nav_labels((await http.get("/admin")).text)
        assert "Tenants" in overview and "Audit log" in overview
        for path in (*unknown, "/admin/tenants/nope"):  # no such page; no such tenant
            page = await http.get(path)
            assert page.status_code == 404, path
            assert nav_labels(page.text) == overview, path
            assert 'action="/admin/logout"' in page.text  # and a way out


TIERS = re.compile(r'<dl class="tiers[^"]*">(.*?)</dl>', re.S)
TIER = re.compile(r"<dt>([^<]+)</dt>\s*<dd[^>]*>([^<]+)</dd>")


def tier_counts(html: str) -> list[tuple[str, str]]:
    found = TIERS.search(html)
    assert found, "no adapter tiers on the page"
    return TIER.findall(found.group(1))


async def test_the_adapter_tiers_have_one_set_of_words(web: WebEnv) -> None:
    """The engine counts adapters ready in its device pool, parsed in host memory, and every
    one registered with it (``AdapterResidency.counts``: its "disk" entry is all of them, the
    two others included); the overview called that total "disk", the Adapters page
    "registered"."""
    web.fake.engine_stats.update(lora_resident_device=2, lora_resident_host=3, lora_registered=5)
    expected = [("device", "2"), ("host", "3"), ("registered", "5")]
    async with web.http() as http:
        await sign_in(http)
        assert tier_counts((await http.get("/admin")).text) == expected
        assert tier_counts((await http.get("/admin/adapters")).text) == expected
        display = (await http.get("/admin/overview.json")).json()["engine"]["display"]
        assert (display["adapters_device"], display["adapters_registered"]) == ("2", "5")
