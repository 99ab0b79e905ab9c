"""The registry as the resolver of tenant callers' ``model`` fields (``ModelResolver.tenant_models``).

``model`` is ``name`` (the newest ready version) or ``name@N``, looked up in the caller's tenant
only; anything else (another tenant's adapter, a version still validating, a malformed name) is
None, which the resolver answers with the same 404 ``model_not_found`` as a missing model.
``/v1/models`` lists, per adapter with a ready version, ``name`` (the newest) and every ready
``name@N``, each with ``parent`` = the base model, ``owned_by`` = the tenant, and ``created`` =
when that version was uploaded. Resolving reads the database only: the resolved model's
``prepare`` loads the version into the engine where it is not there (``load_for_request``), and
the serving layer calls it once the request is admitted.
"""

from __future__ import annotations

import functools

from loraplex.platform.auth import Caller
from loraplex.platform.model_resolver import ModelEntry, ResolvedModel
from loraplex.platform.registry.names import parse_ref
from loraplex.platform.registry.service import Registry, parse_tenant_id


class RegistryModels:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def resolve(self, caller: Caller, name: str) -> ResolvedModel | None:
        tenant_id = parse_tenant_id(caller.tenant_id)
        ref = parse_ref(name)
        if tenant_id is None or ref is None:
            return None
        version = await self.registry.find_ready(tenant_id, ref)
        if version is None:
            return None
        return ResolvedModel(
            served_name=version.model_id,
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
            entries.append(
                ModelEntry(
                    adapter.name, int(latest.created_at.timestamp()), base, owned_by=adapter.tenant
                )
            )
            entries += [
                ModelEntry(
                    f"{adapter.name}@{v.number}",
                    int(v.created_at.timestamp()),
                    base,
                    owned_by=adapter.tenant,
                )
                for v in ready
            ]
        return entries
