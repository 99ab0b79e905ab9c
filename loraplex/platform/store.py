"""The platform's persistent state: its settings, its database and its data directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from loraplex.platform.db.database import Database
from loraplex.platform.settings import TenancySettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Store:
    settings: TenancySettings
    db: Database

    @property
    def data_dir(self) -> Path:
        return self.settings.data_dir

    @classmethod
    def open(cls, settings: TenancySettings) -> Store:
        """The data directory is created private (0700); an existing one open to others is
        left as it is (it may be shared on purpose) with a warning."""
        data_dir = settings.data_dir
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if data_dir.stat().st_mode & 0o077:
            logger.warning(
                "the data directory %s is open to other users; `chmod 700` it (it holds the "
                "database and every tenant's adapters)",
                data_dir,
            )
        return cls(settings, Database(settings.resolved_database_url))
