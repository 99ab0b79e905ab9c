"""Fixtures of the admin UI tests: an app per test (``web``), and headless Chromium."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.utils.web import WebEnv


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def web(tmp_path: Path) -> Iterator[WebEnv]:
    env = WebEnv.build(tmp_path)
    try:
        yield env
    finally:
        env.close()
