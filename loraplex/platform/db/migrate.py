"""Schema migrations, run from code: ``upgrade(url)``, ``downgrade(url, rev)``, ``current(url)``.

The revisions live in the ``loraplex.migrations`` package (shipped in the wheel); no
``alembic.ini`` is needed. A target is a database URL, an ``Engine`` or an open ``Connection``:
a URL gets its own engine (SQLite in WAL mode with foreign keys on, as the server opens it),
disposed afterwards.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine

from loraplex.platform.db.database import make_engine

Target = str | Engine | Connection
T = TypeVar("T")


def _script_location() -> Path:
    """The revisions' package, found without importing it: the migrations import the platform's
    models (the revisions sit above the platform), not the other way round."""
    spec = importlib.util.find_spec("loraplex.migrations")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the loraplex.migrations package is missing from this installation")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


SCRIPT_LOCATION = _script_location()
# PostgreSQL advisory lock held while migrating ("loraplex" in ASCII): replicas take turns.
LOCK_KEY = 0x6C6F7261706C6578


class MigrationError(Exception):
    """A migration could not run or the schema is not what this loraplex needs; says what to do."""


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    return config


def script_directory() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head() -> str:
    """The newest revision this version of loraplex knows."""
    revision = script_directory().get_current_head()
    assert revision is not None, "loraplex.migrations has no revisions"
    return revision


@contextmanager
def _connection(target: Target) -> Iterator[Connection]:
    if isinstance(target, Connection):
        yield target
        return
    engine = make_engine(target) if isinstance(target, str) else target
    try:
        with engine.connect() as connection:
            yield connection
            if connection.in_transaction():
                connection.commit()
    finally:
        if isinstance(target, str):
            engine.dispose()


def _with_alembic(target: Target, action: Callable[[Config], T]) -> T:
    config = alembic_config()
    with _connection(target) as connection:
        config.attributes["connection"] = connection
        try:
            return action(config)
        except CommandError as exc:
            raise MigrationError(_explain(exc, connection)) from exc


def _explain(exc: CommandError, connection: Connection) -> str:
    message = " ".join(str(exc).split())
    if "Can't locate revision" not in message:
        return message
    known = [script.revision for script in script_directory().walk_revisions()]
    at = _current(connection)
    if at is not None and at not in known:
        return (
            f"the database is at schema revision {at!r}, which this loraplex does not know "
            f"(its newest is {head()!r}); it was migrated by a newer loraplex: upgrade loraplex "
            "or use another database"
        )
    wanted = message.split("identified by", 1)[-1].strip(" .")
    return (
        f"there is no schema revision {wanted}; the revisions are "
        f"{', '.join(reversed(known))} (or 'head', the newest; 'base', before the first)"
    )


def upgrade(target: Target, revision: str = "head") -> None:
    """Migrate up to ``revision`` (default: the newest); a no-op when already there."""
    _with_alembic(target, lambda config: command.upgrade(config, revision))


def downgrade(target: Target, revision: str) -> None:
    """Migrate down to ``revision`` (``"base"``: an empty database, no platform tables)."""
    _with_alembic(target, lambda config: command.downgrade(config, revision))


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def current(target: Target) -> str | None:
    """The database's revision; None for an empty (never migrated) database."""
    with _connection(target) as connection:
        return _current(connection)


def is_up_to_date(target: Target) -> bool:
    return current(target) == head()


def require_up_to_date(target: Target) -> None:
    """Raise ``MigrationError`` unless the schema is at the newest revision (``--no-migrate``)."""
    at, newest = current(target), head()
    if at != newest:
        state = "empty" if at is None else f"at revision {at!r}"
        raise MigrationError(
            f"the database schema is {state} but this loraplex needs {newest!r}; run "
            "'loraplex db upgrade' (or start serve without --no-migrate)"
        )


def make_revision(target: Target, message: str, rev_id: str) -> None:
    """Autogenerate a new revision from the models' difference with ``target`` (a database at
    head). For developers: review the generated file by hand before committing it."""
    _with_alembic(
        target,
        lambda config: command.revision(config, message, autogenerate=True, rev_id=rev_id),
    )


def prepare(target: Target, *, run_migrations: bool = True) -> None:
    """At server start: migrate to the newest schema, or with ``--no-migrate`` (migrations are
    run out of band with ``loraplex db upgrade``) refuse to start on an older schema."""
    if run_migrations:
        upgrade(target)
    else:
        require_up_to_date(target)
