"""``TenantScope``: the one place where queries of tenant-owned rows are filtered by tenant.

Routes and services never write ``where(X.tenant_id == ...)`` themselves; they ask a scope built
from the caller's tenant. A row of another tenant is simply not found, so callers answer it
exactly as they answer a missing one.
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from loraplex.platform.db.models import (
    Adapter,
    AdapterVersion,
    ApiKey,
    Budget,
    RequestLogEntry,
    Tenant,
    UsageDaily,
    UsageRecord,
)

M = TypeVar("M", ApiKey, Adapter, UsageRecord, UsageDaily, Budget, RequestLogEntry)


def find_key(session: Session, public_id: str) -> tuple[ApiKey, Tenant] | None:
    """The key with ``public_id`` and its tenant, whichever tenant it is. The one lookup that
    crosses tenants: authentication, which is what tells whose request it is."""
    row = session.execute(
        select(ApiKey, Tenant)
        .join(Tenant, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.public_id == public_id)
    ).first()
    return (row[0], row[1]) if row is not None else None


class TenantScope:
    def __init__(self, session: Session, tenant_id: int) -> None:
        self.session = session
        self.tenant_id = tenant_id

    def tenant(self) -> Tenant:
        tenant = self.session.get(Tenant, self.tenant_id)
        if tenant is None:
            raise LookupError(f"tenant {self.tenant_id} does not exist")
        return tenant

    def select(self, model: type[M]) -> Select[M]:
        """``select(model)`` restricted to this tenant's rows."""
        return select(model).where(model.tenant_id == self.tenant_id)

    def select_versions(self) -> Select[AdapterVersion]:
        """Adapter versions of this tenant's adapters (versions reach the tenant via Adapter)."""
        return (
            select(AdapterVersion)
            .join(Adapter, AdapterVersion.adapter_id == Adapter.id)
            .where(Adapter.tenant_id == self.tenant_id)
        )

    def all(self, model: type[M], *where: Any) -> list[M]:
        return list(self.session.scalars(self.select(model).where(*where)))

    def adapter(self, name: str) -> Adapter | None:
        return self.session.scalars(self.select(Adapter).where(Adapter.name == name)).first()

    def key(self, public_id: str) -> ApiKey | None:
        return self.session.scalars(
            self.select(ApiKey).where(ApiKey.public_id == public_id)
        ).first()

    def add(self, row: M) -> M:
        """Add ``row`` as this tenant's, whatever owner it was given."""
        row.tenant_id = self.tenant_id
        self.session.add(row)
        return row
