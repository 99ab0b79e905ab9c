"""What leaves the registry's database sessions: plain frozen records (no ORM rows, no storage
paths), built inside the session that read them."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from loraplex.platform.db.models import Adapter, AdapterVersion
from loraplex.platform.errors import NOT_FOUND, APIError, clip


@dataclass(frozen=True)
class VersionView:
    id: int
    number: int
    status: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int
    content_sha256: str
    created_at: dt.datetime


@dataclass(frozen=True)
class AdapterView:
    name: str
    tenant: str
    description: str
    created_at: dt.datetime
    versions: tuple[VersionView, ...]  # by number

    @property
    def latest_ready(self) -> VersionView | None:
        ready = [v for v in self.versions if v.status == "ready"]
        return ready[-1] if ready else None


@dataclass(frozen=True)
class ResolvedVersion:
    """A ready version, found for a request: what the engine needs to serve it."""

    adapter: str
    version_id: int
    number: int
    content_sha256: str
    storage_path: str
    tenant: str

    @property
    def model_id(self) -> str:
        return f"{self.adapter}@{self.number}"


def version_view(v: AdapterVersion) -> VersionView:
    return VersionView(
        v.id, v.number, v.status, v.rank, v.alpha, tuple(v.target_modules), v.size_bytes,
        v.content_sha256, v.created_at,
    )  # fmt: skip


def adapter_view(adapter: Adapter, tenant: str) -> AdapterView:
    versions = tuple(version_view(v) for v in sorted(adapter.versions, key=lambda v: v.number))
    return AdapterView(adapter.name, tenant, adapter.description, adapter.created_at, versions)


def adapter_not_found(ref: str) -> APIError:
    """The one answer for an adapter that is missing or another tenant's."""
    return APIError(
        404,
        f"No adapter {clip(ref)}; GET /v1/adapters lists your adapters and their versions.",
        type=NOT_FOUND,
        param="name",
        code="adapter_not_found",
    )
