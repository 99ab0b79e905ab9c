"""Headless Chromium (Debian's ``chromium``) driven by Playwright, for the admin UI's browser
tests: ``browser`` (one per module) and ``shot(page, name)``, which takes a full-page screenshot
at desktop (1280×800) and phone width (390×844) into ``screenshots/webui/`` (git ignored;
``LORAPLEX_SCREENSHOTS`` picks another folder), each checked for horizontal overflow.

A test module binds the fixtures by assignment (``browser = base.browser``) and marks itself
``pytestmark = base.needs_chromium``; importing this module skips the importer where Playwright
is missing.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("LORAPLEX_CHROMIUM") or shutil.which("chromium") or ""
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
SCREENSHOTS = Path(
    os.environ.get("LORAPLEX_SCREENSHOTS") or Path(__file__).parents[2] / "screenshots" / "webui"
)

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="the browser tests need Playwright: pip install playwright"
)
needs_chromium = pytest.mark.skipif(
    not CHROMIUM,
    reason="the browser tests need Chromium: apt-get install chromium (or set LORAPLEX_CHROMIUM)",
)
expect = sync_api.expect


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        try:
            yield browser
        finally:
            browser.close()


Shot = Callable[[Any, str], None]


@pytest.fixture
def shot() -> Shot:
    """``shot(page, name)``: full-page screenshots at desktop and phone width, each checked for
    horizontal overflow; the viewport is left at desktop size."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def take(page: Any, name: str) -> None:
        for label, size in (("desktop", DESKTOP), ("phone", PHONE)):
            page.set_viewport_size(size)
            page.wait_for_timeout(50)  # one layout pass after the resize
            overflow = page.evaluate(
                "document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            assert overflow <= 0, f"{name} overflows by {overflow}px at {label} width"
            page.screenshot(path=str(SCREENSHOTS / f"{name}-{label}.png"), full_page=True)
        page.set_viewport_size(DESKTOP)

    return take
