"""Bounded label sets for ``/metrics``: which tenants and adapter versions get series of their
own, and the removal of the series of those deleted.

Every per-tenant and per-adapter label of ``/metrics`` goes through one ``LabelBudget``:

* the first ``max_tenants`` tenant ids seen get their own ``tenant`` label, later ones are
  summed as ``tenant="_other"``; likewise the first ``max_adapters`` adapter versions get their
  own ``model`` label (``name@N``, beside their tenant's id), later ones ``model="_other"``
  (and so are the adapters of a tenant in ``_other``);
* at each scrape the budget asks the database which of the tenants and versions it names still
  exist (``gone``: one query each, chunked, in a worker thread, within a timeout); those deleted
  are released: the metrics remove their series and their places go to newcomers.

Whatever deleted them (the admin API, the admin UI, ``loraplex admin`` on the database, another
replica), the next scrape drops their series, so ``/metrics`` goes back to its size before them.
A read that fails or takes too long removes nothing (the next scrape tries again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import InstrumentedAttribute, Session

from loraplex.platform.db.database import Database
from loraplex.platform.db.models import AdapterVersion, Tenant

logger = logging.getLogger(__name__)

OTHER = "_other"
NO_TENANT = "-"  # the operator's requests (and requests without a tenant in the engine)
MAX_TENANTS = 500
MAX_ADAPTERS = 1000
READ_TIMEOUT_S = 2.0
READ_CHUNK = 500  # ids per IN (...) clause: under every database's parameter limit

AdapterLabels = tuple[str, str]  # (tenant label, model label) of an adapter version's series


@dataclass(frozen=True)
class Gone:
    """What a scrape found deleted: tenant ids, and the label pairs whose series go (every
    adapter series of those tenants, and of the deleted versions)."""

    tenants: frozenset[str] = frozenset()
    adapters: frozenset[AdapterLabels] = frozenset()


def existing_ids(
    session: Session, column: InstrumentedAttribute[int], ids: Collection[int]
) -> set[int]:
    """Which of ``ids`` are rows of ``column``'s table now (an operator-wide read: only ids)."""
    found: set[int] = set()
    keys = sorted(ids)
    for start in range(0, len(keys), READ_CHUNK):
        chunk = keys[start : start + READ_CHUNK]
        found.update(session.scalars(select(column).where(column.in_(chunk))))
    return found


def _as_id(text: str) -> int | None:
    return int(text) if text.isdigit() else None


class LabelBudget:
    """The tenants and adapter versions with series of their own (see the module's docstring).
    ``db`` None (the single-operator server): nothing is ever found deleted."""

    def __init__(
        self,
        db: Database | None = None,
        *,
        max_tenants: int = MAX_TENANTS,
        max_adapters: int = MAX_ADAPTERS,
        timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.db = db
        self.max_tenants = max_tenants
        self.max_adapters = max_adapters
        self.timeout_s = timeout_s
        self._tenants: dict[str, None] = {}  # own-labelled tenant ids, first seen first
        # (tenant label, model) -> the registry's version id (None: an operator's adapter)
        self._adapters: dict[AdapterLabels, int | None] = {}

    def tenant(self, tenant_id: str | None) -> str:
        """The ``tenant`` label of ``tenant_id`` (None: the operator, ``-``)."""
        if tenant_id is None or tenant_id == NO_TENANT or tenant_id in self._tenants:
            return tenant_id or NO_TENANT
        if len(self._tenants) >= self.max_tenants:
            return OTHER
        self._tenants[tenant_id] = None
        return tenant_id

    def adapter(self, tenant: str, model: str, version_id: int | None) -> str:
        """The ``model`` label of an adapter version served to ``tenant`` (a label)."""
        key = (tenant, model)
        if key in self._adapters:
            if version_id is not None:  # name@N made anew after a deletion: the newest counts
                self._adapters[key] = version_id
            return model
        if tenant == OTHER or len(self._adapters) >= self.max_adapters:
            return OTHER
        self._adapters[key] = version_id
        return model

    @property
    def tenants(self) -> list[str]:
        return list(self._tenants)

    async def gone(self, tenants: Iterable[str] = ()) -> Gone:
        """Which of the budget's tenants and versions, and of ``tenants`` (ids the engine
        reports), the database no longer has; releases them."""
        if self.db is None:
            return Gone()
        tenant_ids = {i for t in {*self._tenants, *tenants} if (i := _as_id(t)) is not None}
        version_ids = {v for v in self._adapters.values() if v is not None}
        if not tenant_ids and not version_ids:
            return Gone()

        def read(session: Session) -> tuple[set[int], set[int]]:
            return (
                existing_ids(session, Tenant.id, tenant_ids),
                existing_ids(session, AdapterVersion.id, version_ids),
            )

        try:
            live_tenants, live_versions = await asyncio.wait_for(self.db.run(read), self.timeout_s)
        except Exception as exc:  # the scrape goes on; the next one tries again
            logger.warning("metrics: cannot read which tenants and versions exist: %s", exc)
            return Gone()
        dead_tenants = frozenset(str(i) for i in tenant_ids - live_tenants)
        dead_versions = version_ids - live_versions
        adapters = frozenset(
            key
            for key, version in self._adapters.items()
            if key[0] in dead_tenants or version in dead_versions
        )
        for key in adapters:
            del self._adapters[key]
        for tenant in dead_tenants:
            self._tenants.pop(tenant, None)
        return Gone(dead_tenants, adapters)
