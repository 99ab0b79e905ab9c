"""``Database``: one SQLAlchemy engine and its sessions, for any URL.

SQLite (the default) runs in WAL mode with foreign keys on and a busy timeout, so the server's
threads and a ``loraplex admin`` command can use one file at once. Its files are private to the
server's user: each new connection makes the database file 0600 before it sets WAL mode (SQLite
gives ``-wal`` and ``-shm`` the database file's mode; they are checked too), and a directory
created for it is 0700. The platform's handlers are async and SQLAlchemy sessions are not:
``await db.run(fn)`` runs ``fn(session)`` in a worker thread inside one transaction (committed
when ``fn`` returns, rolled back when it raises).
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio.to_thread
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")
logger = logging.getLogger(__name__)
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


def sqlite_url(path: str | Path) -> str:
    return f"sqlite:///{Path(path).resolve()}"


def _sqlite_pragmas(path: Path | None, dbapi_conn: Any, _record: Any) -> None:
    if path is not None:  # the connection has created the file (0644 less the umask)
        _make_private(path)
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()
    if path is not None:
        _make_private(path)


def _make_private(path: Path) -> None:
    """Take group and other access away from the database file and its side files."""
    for file in (path, *(path.with_name(path.name + s) for s in SQLITE_SIDE_FILES)):
        try:
            mode = stat.S_IMODE(file.stat().st_mode)
            if mode & 0o077:
                os.chmod(file, mode & 0o700)
        except FileNotFoundError:
            continue
        except OSError as exc:  # not ours to change: say so, and go on
            logger.warning("cannot make %s private (%s); chmod 600 it", file, exc.strerror)


def make_engine(url: str) -> Engine:
    """An engine for ``url``; for a SQLite file, its directory is created first."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    database = parsed.database
    path = None
    if database and database != ":memory:" and not database.startswith("file:"):
        path = Path(database)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False})
    event.listen(engine, "connect", functools.partial(_sqlite_pragmas, path))
    return engine


class Database:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on an exception."""
        with self._sessions() as session, session.begin():
            yield session

    def call(self, fn: Callable[[Session], T]) -> T:
        with self.session() as session:
            return fn(session)

    async def run(self, fn: Callable[[Session], T]) -> T:
        """``fn(session)`` in a worker thread, in one transaction."""
        return await anyio.to_thread.run_sync(self.call, fn)

    def dispose(self) -> None:
        self.engine.dispose()
