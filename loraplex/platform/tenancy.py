"""The multi-tenant platform around the OpenAI API: database, tenant keys, adapter registry,
quotas, usage and audit, and the admin API.

``create_app(client, settings)`` builds the single-operator server; ``create_app(...,
platform=Platform.open(settings))`` the platform: ``install_tenancy`` installs each component's
state on ``app.state``, and ``app.mount_routes`` mounts every route with its audience.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from loraplex.platform.db.database import Database, sqlite_url

logger = logging.getLogger(__name__)


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "loraplex"


class TenancySettings(BaseSettings):
    """Platform settings; environment variables ``LORAPLEX_<NAME>`` override them."""

    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", extra="ignore", frozen=True)

    data_dir: Path = Field(default_factory=default_data_dir, description="database and adapters")
    database_url: str | None = Field(None, description="any SQLAlchemy URL; default SQLite file")
    admin_token: SecretStr | None = Field(
        None, description="the operator's credential; generated and printed once when unset"
    )
    share_prefix_cache: bool = Field(
        False, description="let tenants share prefix-cache blocks of the base model"
    )
    max_adapter_bytes: int = Field(512 * 1024 * 1024, ge=1024, description="per upload")
    max_adapters_per_tenant: int = Field(
        100, ge=1, description="adapters per tenant unless the tenant's own limit is set"
    )
    max_concurrent_uploads: int = Field(
        2, ge=1, le=256, description="uploads received and validated at once; more get 429"
    )
    usage_retention_days: int = Field(30, ge=1, description="raw usage rows; roll-ups stay")

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or sqlite_url(self.data_dir / "loraplex.db")


@dataclass
class Platform:
    settings: TenancySettings
    db: Database

    @property
    def data_dir(self) -> Path:
        return self.settings.data_dir

    @classmethod
    def open(cls, settings: TenancySettings) -> Platform:
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


def tenant_limits_changed(app: FastAPI, tenant_id: int) -> None:
    """A tenant's quotas or status changed: they apply from its next request."""
    quotas = getattr(app.state, "quotas", None)
    if quotas is not None:
        quotas.invalidate(tenant_id)


async def tenant_deleted(app: FastAPI, tenant_id: int) -> None:
    """The database dropped a deleted tenant's rows (cascades); its quota state goes here and its
    adapters' files and engine copies through the registry (a failure waits for the next
    collection: nothing names those files any more)."""
    quotas = getattr(app.state, "quotas", None)
    if quotas is not None:
        quotas.forget(tenant_id)
    registry = getattr(app.state, "registry", None)
    if registry is not None:
        try:
            await registry.collect_garbage()
        except Exception:
            logger.exception("removing the adapters of a deleted tenant failed")


def install_tenancy(app: FastAPI, platform: Platform) -> None:
    """The platform's components on ``app.state`` (``create_app(..., platform=)`` calls this;
    ``app.mount_routes`` mounts their routes)."""
    from loraplex.platform import quotas, registry, tenant_auth, usage

    app.state.platform = platform
    tenant_auth.install(app, platform)
    registry.install(app, platform)
    quotas.install(app, platform)
    usage.install(app, platform)

    from loraplex.webui import install_webui

    install_webui(app, platform)
