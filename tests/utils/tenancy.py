"""A multi-tenant app on the fake engine, with a fresh database per test.

``async with tenancy_env(tmp_path, fake, tokenizer) as env``: ``env.http`` is an httpx client on
the app, ``env.tenant(name)`` creates a tenant with a key and returns the key,
``env.admin_headers`` authenticates as the operator. The database is a SQLite file in the data
directory, or ``database_url=`` (the ``tenancy`` fixture passes a fresh PostgreSQL database for
its ``postgresql`` half). Its schema comes from the migrations, as in production: a SQLite
template migrated once per session is copied for each test (migrating each one is slower).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.engine import make_url

from loraplex.platform import tenants
from loraplex.platform.db import migrate
from loraplex.platform.db.database import sqlite_url
from loraplex.platform.settings import ServerSettings, TenancySettings
from loraplex.platform.store import Store
from loraplex.server import LoraplexApp, create_app
from tests.utils.fakes import FakeEngineClient

ADMIN_TOKEN = "lpx-admin-test-token-0123456789abcdef"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@functools.cache
def sqlite_template() -> Path:
    """A SQLite file migrated to head, once per process (in WAL mode, checkpointed: one file)."""
    folder = Path(tempfile.mkdtemp(prefix="loraplex-schema-"))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "template.db"
    migrate.upgrade(sqlite_url(path))  # its engine is disposed: the WAL is folded into the file
    return path


def _sqlite_file(store: Store) -> Path | None:
    database = make_url(store.db.url).database if store.db.is_sqlite else None
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def prepare_schema(store: Store) -> None:
    """Bring the test database to the newest schema through the migrations."""
    path = _sqlite_file(store)
    if path is not None and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sqlite_template(), path)
        return
    migrate.upgrade(store.db.engine)  # a no-op for a database made from a migrated template


@dataclass
class TenancyEnv:
    app: LoraplexApp
    store: Store
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
        with self.store.db.session() as session:
            tenant = tenants.get_tenant(session, name)
            if tenant is None:
                tenant = tenants.create_tenant(
                    session, "admin", name, quotas=quotas or tenants.Quotas()
                )
            _, new = tenants.create_key(session, "admin", tenant, scopes=scopes)
        return new.token


def platform_for(tmp_path: Path, **settings: Any) -> Store:
    # admin_token=None in ``settings``: the platform generates one (see admin_token.ensure).
    tenancy = TenancySettings(
        **{"data_dir": tmp_path / "data", "admin_token": ADMIN_TOKEN, **settings}
    )
    store = Store.open(tenancy)
    prepare_schema(store)
    return store


@asynccontextmanager
async def tenancy_env(
    tmp_path: Path,
    fake: FakeEngineClient,
    tokenizer: Any,
    *,
    server: ServerSettings | None = None,
    **settings: Any,
) -> AsyncIterator[TenancyEnv]:
    """``server``: the HTTP server's settings; ``settings``: ``TenancySettings`` fields."""
    store = platform_for(tmp_path, **settings)
    app = create_app(fake, server or ServerSettings(), tokenizer=tokenizer, store=store)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield TenancyEnv(app, store, fake, http)
    finally:
        store.db.dispose()
