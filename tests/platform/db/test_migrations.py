"""The migrations build exactly the models' schema, on SQLite and PostgreSQL, and undo it."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import IntegrityError

from loraplex.platform.db import migrate
from loraplex.platform.db.database import Database, make_engine, sqlite_url
from loraplex.platform.db.migrate import LOCK_KEY
from loraplex.platform.db.models import ApiKey, Base, Tenant

REPO = Path(__file__).resolve().parents[3]


def schema_differences(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_empty_database_upgrades_to_exactly_the_models_and_back_to_nothing(
    empty_database_url: str,
) -> None:
    url = empty_database_url
    assert migrate.current(url) is None
    assert not migrate.is_up_to_date(url)
    migrate.upgrade(url)
    assert migrate.current(url) == migrate.head() == "0007"
    assert migrate.is_up_to_date(url)
    assert table_names(url) == set(Base.metadata.tables) | {"alembic_version"}
    assert schema_differences(url) == []

    migrate.downgrade(url, "base")
    assert migrate.current(url) is None
    assert table_names(url) <= {"alembic_version"}  # Alembic's own bookkeeping, now empty


def test_upgrade_again_is_a_no_op_that_keeps_the_data(empty_database_url: str) -> None:
    url = empty_database_url
    migrate.upgrade(url)
    db = Database(url)
    try:
        with db.session() as session:
            session.add(Tenant(name="acme", cache_salt="s"))
        migrate.upgrade(url)
        migrate.upgrade(db.engine)  # an Engine works as a target too
        with db.session() as session:
            assert [t.name for t in session.query(Tenant)] == ["acme"]
    finally:
        db.dispose()
    assert migrate.current(url) == migrate.head()
    assert schema_differences(url) == []


def test_sqlite_is_in_wal_mode_with_foreign_keys_on(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "platform.db")
    db = Database(url)
    try:
        # Migrating through the server's own engine: its pooled connection must come back
        # with foreign keys on (the migrations turn them off while they run).
        migrate.upgrade(db.engine)
        with db.session() as session:
            assert session.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert session.execute(text("PRAGMA foreign_keys")).scalar() == 1
        with pytest.raises(IntegrityError), db.session() as session:
            session.add(
                ApiKey(tenant_id=999, public_id="x" * 12, secret_sha256="0" * 64, last4="abcd")
            )
    finally:
        db.dispose()
    # WAL is a property of the file: a plain connection sees it too.
    plain = create_engine(url)
    try:
        with plain.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        plain.dispose()


def test_a_database_from_a_newer_loraplex_is_refused_clearly(empty_database_url: str) -> None:
    url = empty_database_url
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    finally:
        engine.dispose()
    with pytest.raises(migrate.MigrationError, match=r"newer loraplex"):
        migrate.upgrade(url)
    with pytest.raises(migrate.MigrationError, match=r"loraplex db upgrade"):
        migrate.require_up_to_date(url)


def test_serve_start_migrates_or_with_no_migrate_refuses_an_old_schema(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "fresh.db")
    with pytest.raises(migrate.MigrationError, match=r"empty.*'loraplex db upgrade'"):
        migrate.prepare(url, run_migrations=False)
    migrate.prepare(url)
    assert migrate.is_up_to_date(url)
    migrate.prepare(url, run_migrations=False)


def test_the_migrations_ship_inside_the_wheel() -> None:
    """Every file Alembic needs is in a package or matched by package-data."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    location = migrate.SCRIPT_LOCATION
    assert location.is_relative_to(REPO / "loraplex")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["loraplex"]
    for path in location.rglob("*"):
        if path.is_dir() or "__pycache__" in path.parts:
            continue
        relative = path.relative_to(REPO / "loraplex").as_posix()
        if path.suffix == ".py":
            assert (path.parent / "__init__.py").exists(), f"{relative} is not in a package"
        else:
            assert any(fnmatch.fnmatch(relative, p) for p in patterns), f"{relative} not shipped"


def test_replicas_starting_together_migrate_one_after_the_other(pg_server: Any) -> None:
    """Two processes upgrade one PostgreSQL database at once: the advisory lock queues them."""
    url = pg_server.create_database(migrated=False)
    holder = create_engine(url)  # advisory locks are per database
    script = "import sys; from loraplex.platform.db import migrate; migrate.upgrade(sys.argv[1])"
    try:
        with holder.connect() as lock:
            lock.execute(text("SELECT pg_advisory_lock(:k)"), {"k": LOCK_KEY})
            replicas = [
                subprocess.Popen([sys.executable, "-c", script, url], cwd=REPO, stderr=PIPE)
                for _ in range(2)
            ]
            waiting_sql = text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            )
            deadline = time.monotonic() + 60
            # Until both wait for the lock (one that did not wait has run unguarded: a failure).
            while lock.execute(waiting_sql).scalar() != 2:
                assert all(r.poll() is None for r in replicas), "a replica did not wait"
                assert time.monotonic() < deadline, "the replicas never reached the lock"
                time.sleep(0.1)
            lock.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": LOCK_KEY})
            lock.commit()
        for replica in replicas:
            _, err = replica.communicate(timeout=60)
            assert replica.returncode == 0, err.decode()
        assert migrate.current(url) == migrate.head()
        assert schema_differences(url) == []
    finally:
        holder.dispose()
        pg_server.drop_database(url)
