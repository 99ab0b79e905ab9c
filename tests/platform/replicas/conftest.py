"""Two platform replicas on one database: two apps, each with its own fake engine and its own
data directory (no shared filesystem), with ``shared_state="database"`` and their lifespans
running (the change feed, the lease heartbeat). The database is a fresh PostgreSQL one (skipped
where PostgreSQL is missing) or, for the ``sqlite`` half, one SQLite file both open."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from loraplex.platform.db.database import sqlite_url
from tests.utils.fakes import FakeEngineClient
from tests.utils.tenancy import TenancyEnv, tenancy_env

SHARED = ["sqlite", "postgresql"]


@pytest.fixture(params=SHARED)
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a fresh database at the newest schema that both replicas open."""
    if request.param == "sqlite":
        yield sqlite_url(tmp_path / "shared.db")
        return
    server = request.getfixturevalue("pg_server")
    url = server.create_database()
    yield url
    server.drop_database(url)


@pytest.fixture
def pg_url(pg_server: Any) -> Iterator[str]:
    url = pg_server.create_database()
    yield url
    pg_server.drop_database(url)


async def open_replicas(
    stack: AsyncExitStack,
    tmp_path: Path,
    tokenizer_dir: str,
    tokenizer: Any,
    url: str,
    *,
    count: int = 2,
    client: Any = None,
    **settings: Any,
) -> list[TenancyEnv]:
    """``count`` replicas on ``url``, each in its own data directory, lifespans entered.
    ``client(name)``: builds each replica's engine (default: the fake engine)."""
    envs = []
    for index in range(count):
        name = "ab"[index] if count <= 2 else str(index)
        fake = client(tmp_path / name) if client else FakeEngineClient(model_dir=tokenizer_dir)
        env = await stack.enter_async_context(
            tenancy_env(
                tmp_path / name,
                fake,
                tokenizer,
                database_url=url,
                shared_state="database",
                replica_poll_s=0.05,
                **settings,
            )
        )
        await stack.enter_async_context(env.app.platform.lifespan(own_client=False))
        envs.append(env)
    return envs


@pytest.fixture
async def replicas(
    tmp_path: Path, tokenizer_dir: str, tokenizer: Any, shared_url: str
) -> AsyncIterator[list[TenancyEnv]]:
    async with AsyncExitStack() as stack:
        yield await open_replicas(stack, tmp_path, tokenizer_dir, tokenizer, shared_url)
