"""Fixtures for the HTTP API: a tokenizer with a chat template, the fake engine, the app."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils.app import API_KEY, add_chat_template, make_app
from tests.utils.fakes import FakeEngineClient
from tests.utils.models import TINY_VOCAB, write_tokenizer


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-chat"
    write_tokenizer(path, TINY_VOCAB)
    add_chat_template(path)
    return str(path)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def fake(tokenizer_dir: str) -> FakeEngineClient:
    return FakeEngineClient(model_dir=tokenizer_dir)


@pytest.fixture
async def api(fake: FakeEngineClient, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An open server (no key) on the fake engine."""
    app = make_app(fake, tokenizer, max_request_bytes=64 * 1024)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


@pytest.fixture
async def keyed_api(fake: FakeEngineClient, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A server guarded by the operator key ``API_KEY``."""
    app = make_app(fake, tokenizer, api_key=API_KEY)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Any]:
    """A PostgreSQL server for the whole session (tests/utils/pg.py); skips where there is
    none, saying what is missing."""
    from tests.utils.pg import PostgresServer, unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(f"PostgreSQL tests skipped: {reason}")
    server = PostgresServer.start()
    yield server
    server.stop()


DATABASES = ["sqlite", "postgresql"]


@pytest.fixture(params=DATABASES)
def database_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """A fresh database at the newest schema: None (the default SQLite file in the data dir) or
    the URL of a new PostgreSQL database, dropped after the test."""
    if request.param == "sqlite":
        yield None
        return
    server = request.getfixturevalue("pg_server")
    url = server.create_database()
    yield url
    server.drop_database(url)


@pytest.fixture(params=DATABASES)
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a fresh, empty (never migrated) database: a SQLite file or PostgreSQL."""
    if request.param == "sqlite":
        from loraplex.platform.db.database import sqlite_url

        yield sqlite_url(tmp_path / "empty.db")
        return
    server = request.getfixturevalue("pg_server")
    url = server.create_database(migrated=False)
    yield url
    server.drop_database(url)


@pytest.fixture
async def tenancy(
    tmp_path: Path, fake: FakeEngineClient, tokenizer: Any, database_url: str | None
) -> AsyncIterator[Any]:
    """A multi-tenant app on the fake engine (see tests/utils/tenancy.py), once on SQLite
    and once on PostgreSQL."""
    from tests.utils.tenancy import tenancy_env

    async with tenancy_env(tmp_path, fake, tokenizer, database_url=database_url) as env:
        yield env


# ---- several platform replicas on one database (tests/utils/replicas.py) ----------------------

SHARED = ["sqlite", "postgresql"]


@pytest.fixture(params=SHARED)
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a fresh database at the newest schema that several replicas open: one SQLite
    file, or a PostgreSQL database (skipped where PostgreSQL is missing)."""
    if request.param == "sqlite":
        from loraplex.platform.db.database import sqlite_url

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


@pytest.fixture
async def replicas(
    tmp_path: Path, tokenizer_dir: str, tokenizer: Any, shared_url: str
) -> AsyncIterator[Any]:
    """Two replicas (``list[TenancyEnv]``) on ``shared_url``, lifespans entered."""
    from contextlib import AsyncExitStack

    from tests.utils.replicas import open_replicas

    async with AsyncExitStack() as stack:
        yield await open_replicas(stack, tmp_path, tokenizer_dir, tokenizer, shared_url)
