"""The data directory is private to the server's user: directories 0700, the SQLite database
(and its -wal / -shm) and every stored or uploaded adapter file 0600."""

from __future__ import annotations

import logging
import stat
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from loraplex.platform.db.database import Database, sqlite_url
from loraplex.platform.settings import TenancySettings
from loraplex.platform.store import Store
from tests.utils import registry as rf
from tests.utils.registry import CONFIG, WEIGHTS, registry_env, upload

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_directories_0700_and_files_0600_after_an_upload(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        token = env.tenant("acme")
        r = await upload(env.http, token, "bot", registry_models.adapters["a"].files())
        assert r.status_code == 201, r.text
        data = env.store.data_dir
        stored = data / "adapters" / r.json()["versions"][0]["content_sha256"]
        dirs = [data, data / "adapters", data / "tmp", stored]
        files = [stored / CONFIG, stored / WEIGHTS, data / "loraplex.db"]
        files += [p for p in (data / "loraplex.db-wal", data / "loraplex.db-shm") if p.exists()]
        assert len(files) >= 4  # WAL mode: the -wal file exists while the app is open
        assert {str(d.relative_to(tmp_path)): oct(mode(d)) for d in dirs} == {
            str(d.relative_to(tmp_path)): "0o700" for d in dirs
        }
        assert {f.name: oct(mode(f)) for f in files} == {f.name: "0o600" for f in files}


def test_an_existing_database_is_made_private(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = Database(sqlite_url(path))
    db.call(lambda s: s.execute(text("CREATE TABLE IF NOT EXISTS t (x)")))
    db.dispose()
    for p in tmp_path.iterdir():
        p.chmod(0o644)  # as an earlier release left it
    db = Database(sqlite_url(path))
    db.call(lambda s: s.execute(text("CREATE TABLE IF NOT EXISTS t (x)")))
    assert mode(path) == 0o600
    assert all(mode(p) == 0o600 for p in tmp_path.iterdir()), [
        (p.name, oct(mode(p))) for p in tmp_path.iterdir()
    ]
    db.dispose()


def test_an_existing_open_data_directory_is_left_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o750)
    shared.chmod(0o750)  # the operator's choice (e.g. a backup group): not ours to change
    with caplog.at_level(logging.WARNING):
        platform = Store.open(TenancySettings(data_dir=shared))
    platform.db.dispose()
    assert mode(shared) == 0o750
    assert "chmod 700" in caplog.text
