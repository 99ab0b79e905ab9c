"""The registry as the resolver of tenant callers' ``model`` fields (``ModelResolver.tenant_models``).

``model`` is ``name`` (the newest ready version) or ``name@N``, looked up in the caller's tenant
only; anything else (another tenant's adapter, a version still validating, a malformed name) is
None, which the resolver answers with the same 404 ``model_not_found`` as a missing model.
``/v1/models`` lists, per adapter with a ready version, ``name`` (the newest) and every ready
``name@N``, each with ``parent`` = the base model, ``owned_by`` = the tenant, and ``created`` =
when that version was uploaded. Resolving reads the database only: the resolved model's
``prepare`` loads the version into the engine where it is not there (``load_for_request``), and
the serving layer calls it once the request is admitted.

**Gateway mode** (``TenancySettings.gateway_mode``): every adapter's ``model`` string is
``<tenant>/<name>`` or ``<tenant>/<name>@N``, unique across tenants (tenant and adapter names
hold no ``/``), and it is the one string used everywhere: the ``model`` field (a bare ``name``
is not a model then), ``/v1/models``, responses, and the metrics' ``running_lora_adapters``
(``served_names``), so a gateway's endpoint picker can route on it. Still only the caller's own
tenant resolves: ``other/name`` is answered like a missing model.
"""

from __future__ import annotations

import functools
from collections.abc import Collection

from sqlalchemy.orm import Session

from loraplex.platform.auth import Caller
from loraplex.platform.db.models import AdapterVersion, Tenant
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.model_resolver import ModelEntry, ResolvedModel
from loraplex.platform.registry.names import parse_ref
from loraplex.platform.registry.service import Registry, parse_tenant_id

# (tenant id, content hash) -> the model strings of that tenant's ready versions of that content
ServedNames = dict[tuple[int, str], tuple[str, ...]]


def model_name(tenant: str, ref: str, gateway: bool) -> str:
    """The ``model`` string of a tenant's adapter ``ref`` (``name`` or ``name@N``)."""
    return f"{tenant}/{ref}" if gateway else ref


def served_names(
    session: Session, wanted: Collection[tuple[int, str]], gateway: bool
) -> ServedNames:
    """Per (tenant id, content hash): ``name@N`` of each of the tenant's ready versions with
    that content, and ``name`` where that version is the adapter's newest ready one (requests
    for either run on it), as ``model_name`` writes them. Each tenant's rows through its scope."""
    hashes_of: dict[int, set[str]] = {}
    for tenant_id, key in wanted:
        hashes_of.setdefault(tenant_id, set()).add(key)
    found: ServedNames = {}
    for tenant_id, hashes in sorted(hashes_of.items()):
        tenant = session.get(Tenant, tenant_id)
        if tenant is None:  # deleted meanwhile: its adapters have no names any more
            continue
        scope = TenantScope(session, tenant_id)
        matching = list(
            session.scalars(
                scope.select_versions().where(
                    AdapterVersion.content_sha256.in_(sorted(hashes)),
                    AdapterVersion.status == "ready",
                )
            )
        )
        adapter_ids = sorted({v.adapter_id for v in matching})
        newest: dict[int, int] = {}
        for v in session.scalars(
            scope.select_versions().where(
                AdapterVersion.adapter_id.in_(adapter_ids), AdapterVersion.status == "ready"
            )
        ):
            newest[v.adapter_id] = max(newest.get(v.adapter_id, 0), v.number)
        names: dict[str, list[str]] = {}
        for v in sorted(matching, key=lambda v: (v.adapter.name, v.number)):
            refs = names.setdefault(v.content_sha256, [])
            if newest.get(v.adapter_id) == v.number:
                refs.append(model_name(tenant.name, v.adapter.name, gateway))
            refs.append(model_name(tenant.name, f"{v.adapter.name}@{v.number}", gateway))
        found |= {(tenant_id, key): tuple(refs) for key, refs in names.items()}
    return found


class RegistryModels:
    def __init__(self, registry: Registry, *, gateway: bool | None = None) -> None:
        """``gateway``: gateway mode (default: the registry's ``settings.gateway_mode``)."""
        self.registry = registry
        self.gateway = registry.settings.gateway_mode if gateway is None else gateway

    async def resolve(self, caller: Caller, name: str) -> ResolvedModel | None:
        tenant_id = parse_tenant_id(caller.tenant_id)
        if tenant_id is None:
            return None
        tenant: str | None = None
        if self.gateway:
            tenant, slash, name = name.partition("/")
            if not slash:
                return None
        ref = parse_ref(name)
        if ref is None:
            return None
        version = await self.registry.find_ready(tenant_id, ref)
        if version is None or (tenant is not None and version.tenant != tenant):
            return None
        return ResolvedModel(
            served_name=model_name(version.tenant, version.model_id, self.gateway),
            lora_key=version.content_sha256,
            cache_extra_keys=caller.cache_extra_keys,  # adapters never share across tenants
            adapter_version_id=version.version_id,
            load=functools.partial(self.registry.load_for_request, version),
        )

    async def list_models(self, caller: Caller) -> list[ModelEntry]:
        tenant_id = parse_tenant_id(caller.tenant_id)
        if tenant_id is None:
            return []
        base = self.registry.base_name()
        entries: list[ModelEntry] = []
        for adapter in await self.registry.list_adapters(tenant_id):
            ready = [v for v in adapter.versions if v.status == "ready"]
            if not ready:
                continue
            latest = ready[-1]
            tenant, gateway = adapter.tenant, self.gateway
            entries.append(
                ModelEntry(
                    model_name(tenant, adapter.name, gateway),
                    int(latest.created_at.timestamp()),
                    base,
                    owned_by=tenant,
                )
            )
            entries += [
                ModelEntry(
                    model_name(tenant, f"{adapter.name}@{v.number}", gateway),
                    int(v.created_at.timestamp()),
                    base,
                    owned_by=tenant,
                )
                for v in ready
            ]
        return entries

    async def served_names(self, wanted: Collection[tuple[int, str]]) -> ServedNames:
        """``served_names`` for these (tenant id, content hash) pairs (one database read)."""
        if not wanted:
            return {}
        pairs = sorted(set(wanted))
        return await self.registry.db.run(lambda s: served_names(s, pairs, self.gateway))
