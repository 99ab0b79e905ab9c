"""Fixtures of the admin UI tests: an app per test (``web``), the same signing in through a local
OpenID provider (``sso_web``, with a client on its address: ``sso_http``), and headless
Chromium."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.webui.oidc import OIDCClient
from tests.utils.oidc import BASE, provider, sso_settings
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


@pytest.fixture
def sso_web(tmp_path: Path) -> Iterator[WebEnv]:
    """The admin UI signing in through a local OpenID provider (tests/utils/oidc.py); tests that
    use it are marked ``needs_provider``."""
    env = WebEnv.build(tmp_path)
    try:
        with provider([BASE + "/admin/sso/callback"]) as idp:
            env.webui.sso = OIDCClient(sso_settings(idp.issuer, BASE))
            yield env
    finally:
        env.close()


@pytest.fixture
async def sso_http(sso_web: WebEnv) -> AsyncIterator[httpx.AsyncClient]:
    async with sso_web.http(base_url=BASE) as client:
        yield client
