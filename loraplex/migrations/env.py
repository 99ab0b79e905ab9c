"""Alembic's environment for the platform database.

Run through :mod:`loraplex.platform.db.migrate` (``loraplex db upgrade``), which hands over an open
connection in ``config.attributes["connection"]``; given none, a URL is taken from
``config.attributes["url"]``, the ``sqlalchemy.url`` option, or the platform settings
(``LORAPLEX_DATABASE_URL``, default the SQLite file in the data directory).

SQLite cannot alter tables, so every revision is written in batch mode (``render_as_batch``):
Alembic copies the table. Copying drops the old table, and with foreign keys on, SQLite would
cascade that drop into the child tables; so foreign keys are off while migrations run and
``PRAGMA foreign_key_check`` must find nothing before they are turned back on. On PostgreSQL the
migrations run in one transaction under an advisory lock, so that replicas starting at the same
time do not race.
"""

from __future__ import annotations

from typing import Any

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import Connection, text

from loraplex.platform.db.migrate import LOCK_KEY
from loraplex.platform.db.models import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | bool:
    """Revisions are frozen: they never import the models, so a later change to a model type
    cannot change what an old revision creates."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


OPTIONS: dict[str, Any] = {
    "target_metadata": target_metadata,
    "render_as_batch": True,  # a no-op outside SQLite
    "compare_type": True,
    "render_item": render_item,
}


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if url:
        return str(url)
    from loraplex.platform.settings import TenancySettings

    return TenancySettings.model_validate({}).resolved_database_url


def _pragma(connection: Connection, sql: str, owned: bool) -> None:
    connection.exec_driver_sql(sql)
    if owned:
        connection.commit()  # end the autobegun transaction: the pragma must run outside one


def _run(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    # Commit only what we began: a caller's own transaction stays the caller's to commit.
    owned = not connection.in_transaction()
    if sqlite:
        _pragma(connection, "PRAGMA foreign_keys=OFF", owned)
    try:
        context.configure(connection=connection, **OPTIONS)
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":
                # Replicas starting together migrate one after the other: the second finds the
                # schema at head. The lock is held until this transaction ends.
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LOCK_KEY})
            context.run_migrations()
        if sqlite:
            broken = list(connection.execute(text("PRAGMA foreign_key_check")))
            if broken:
                raise RuntimeError(f"the migration left rows with dangling foreign keys: {broken}")
    finally:
        if sqlite:
            _pragma(connection, "PRAGMA foreign_keys=ON", owned)


def run_offline() -> None:
    """``--sql`` mode: print the SQL instead of running it."""
    context.configure(url=_url(), literal_binds=True, **OPTIONS)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from loraplex.platform.db.database import make_engine

    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
