"""A multi-tenant app on the fake engine, with a fresh SQLite database per test.

``env = TenancyEnv.build(...)``; ``env.http`` is an httpx client on the app, ``env.tenant(name)``
creates a tenant with a key and returns the key, ``env.admin_headers`` authenticates as the
operator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loraplex.platform import tenants
from loraplex.platform.app import ServerSettings, create_app
from loraplex.platform.db.models import Base
from loraplex.platform.tenancy import Platform, TenancySettings, install_tenancy
from tests.platform.fakes import FakeEngineClient

ADMIN_TOKEN = "lpx-admin-test-token-0123456789abcdef"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def prepare_schema(platform: Platform) -> None:
    """Bring the test database to the current schema."""
    Base.metadata.create_all(platform.db.engine)


@dataclass
class TenancyEnv:
    app: Any
    platform: Platform
    fake: FakeEngineClient
    http: httpx.AsyncClient

    @property
    def admin_headers(self) -> dict[str, str]:
        return bearer(ADMIN_TOKEN)

    def tenant(
        self,
        name: str,
        *,
        scopes: tuple[str, ...] = tenants.DEFAULT_KEY_SCOPES,
        quotas: tenants.Quotas | None = None,
    ) -> str:
        """Create tenant ``name`` (unless it exists) and a new key for it; returns the key."""
        with self.platform.db.session() as session:
            tenant = tenants.get_tenant(session, name)
            if tenant is None:
                tenant = tenants.create_tenant(
                    session, "admin", name, quotas=quotas or tenants.Quotas()
                )
            _, new = tenants.create_key(session, "admin", tenant, scopes=scopes)
        return new.token


def platform_for(tmp_path: Path, **settings: Any) -> Platform:
    tenancy = TenancySettings(data_dir=tmp_path / "data", admin_token=ADMIN_TOKEN, **settings)
    platform = Platform.open(tenancy)
    prepare_schema(platform)
    return platform


@asynccontextmanager
async def tenancy_env(
    tmp_path: Path, fake: FakeEngineClient, tokenizer: Any, **settings: Any
) -> AsyncIterator[TenancyEnv]:
    platform = platform_for(tmp_path, **settings)
    app = create_app(fake, ServerSettings(), tokenizer=tokenizer)
    install_tenancy(app, platform)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield TenancyEnv(app, platform, fake, http)
    finally:
        platform.db.dispose()
