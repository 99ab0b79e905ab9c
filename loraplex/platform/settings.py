"""The platform's settings, each from ``LORAPLEX_<NAME>`` environment variables (then flags):
``ServerSettings`` for the HTTP server and the OpenAI API, ``TenancySettings`` for the
multi-tenant platform (database, data directory, uploads, usage retention).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from loraplex.argtypes import parse_size
from loraplex.paths import default_data_dir
from loraplex.platform.db.database import sqlite_url


def _size(value: Any) -> Any:
    return parse_size(value) if isinstance(value, str) else value


# Bytes, also written as the flags write them ("16MiB", "1.5GB": argtypes.parse_size).
ByteSize = Annotated[int, BeforeValidator(_size)]


class ServerSettings(BaseSettings):
    """The HTTP server's settings; environment variables ``LORAPLEX_<NAME>`` override them."""

    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", extra="ignore", frozen=True)

    served_model_name: str | None = Field(
        None, min_length=1, description="the base model's name in the API (default: its dir name)"
    )
    api_key: SecretStr | None = Field(
        None, description="operator key for 'Authorization: Bearer'; None = open server"
    )
    metrics_token: SecretStr | None = Field(
        None, description="token that may read /metrics (besides admin callers)"
    )
    max_request_bytes: ByteSize = Field(
        4 * 1024 * 1024,
        ge=1024,
        le=1024**3,
        description="largest request body accepted (bytes); larger ones get 413 unread. The "
        "default holds the largest useful request at an 8k context (64 prompts of 8,192 token "
        "ids); raise it for longer contexts",
    )
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="max_tokens of a chat request that sets neither max_tokens nor "
        "max_completion_tokens (cut to the room the prompt leaves); None: up to the context. "
        "/v1/completions always defaults to 16, as OpenAI does",
    )
    lora_resolver_dir: Path | None = Field(
        None,
        description="a request from the operator for an unknown adapter X loads DIR/X/ "
        "(vLLM's filesystem resolver), checked like an upload",
    )
    max_n: int = Field(16, ge=1, le=256)
    max_prompts: int = Field(64, ge=1, le=4096)
    metrics_max_tenants: int = Field(
        500,
        ge=1,
        le=100_000,
        description="tenants with series of their own in /metrics; the rest are summed as "
        "tenant '_other'",
    )
    metrics_max_adapters: int = Field(
        1000,
        ge=1,
        le=100_000,
        description="adapter versions with series of their own in /metrics; the rest are "
        "summed as model '_other'",
    )

    @field_validator("metrics_token")
    @classmethod
    def _non_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value():
            raise ValueError("metrics_token must not be empty; leave it unset for none")
        return value


def load_settings(**overrides: Any) -> ServerSettings:
    """Settings from the environment, then ``overrides`` (CLI flags; None values are skipped)."""
    return ServerSettings(**{k: v for k, v in overrides.items() if v is not None})


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
    gateway_mode: bool = Field(
        False,
        description="name every tenant adapter '<tenant>/<adapter>' in the API (model field, "
        "/v1/models, metrics): one string per adapter across tenants, the routing key of a "
        "Kubernetes inference gateway's endpoint picker",
    )
    max_adapter_bytes: ByteSize = Field(
        512 * 1024 * 1024, ge=1024, description="per upload (bytes: 512MiB, 2GB, ...)"
    )
    max_adapters_per_tenant: int = Field(
        100, ge=1, description="adapters per tenant unless the tenant's own limit is set"
    )
    max_concurrent_uploads: int = Field(
        2, ge=1, le=256, description="uploads received and validated at once; more get 429"
    )
    usage_retention_days: int = Field(30, ge=1, description="raw usage rows; roll-ups stay")
    request_log_retention_days: int = Field(
        7, ge=1, le=3650, description="days the request log keeps a request (purged hourly)"
    )
    shared_state: Literal["auto", "local", "database"] = Field(
        "auto",
        description="where quota windows, admin UI sessions and adapter files live: 'local' "
        "(this process and its data dir: one server), 'database' (shared by every platform "
        "replica on the database); auto = database unless the database is SQLite",
    )
    replica_poll_s: float = Field(
        1.0, gt=0, le=60, description="how often a replica reads the change feed (shared state)"
    )
    quota_lease_ttl_s: float = Field(
        30.0,
        ge=1,
        le=3600,
        description="a dead replica's in-flight requests stop counting against concurrency "
        "after this (live replicas renew theirs every third of it)",
    )

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or sqlite_url(self.data_dir / "loraplex.db")

    @property
    def shares_state(self) -> bool:
        """Whether quotas, sessions and adapter files go through the database (replicas)."""
        if self.shared_state == "auto":
            return not self.resolved_database_url.startswith("sqlite")
        return self.shared_state == "database"
