"""Which model a request's ``model`` field names: the base model, or an adapter.

Without tenancy, adapters are loaded by the operator (``/v1/load_lora_adapter``, ``--lora-modules``)
and visible to every caller. With tenancy installed, ``tenant_models`` (the adapter registry)
answers for tenant callers, within their own tenant only: another tenant's adapter is answered
exactly like a missing one (404 ``model_not_found``), and the operator's adapters are not theirs.
Filesystem paths never leave this module's callers.

``lookup`` and ``models`` are the async entry points (the registry reads the database);
``resolve`` and ``list_models`` are the operator's synchronous ones they fall back to. Resolving
has no side effects: a resolved adapter that the engine does not hold yet (a registry version
on its first use) is loaded by ``ResolvedModel.prepare``, which the serving layer calls only
after the request passed its quotas, so a refused request never costs a load.

The resolved model also carries the prefix-cache keys of the request: the caller's tenant salt,
except for base-model requests when the operator lets tenants share the base model's cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from loraplex.engine.client import AdapterInfo, EngineClient
from loraplex.platform.auth import Caller
from loraplex.platform.errors import APIError, model_not_found
from loraplex.platform.model_access import allows


@dataclass(frozen=True)
class ResolvedModel:
    served_name: str  # what responses echo in their ``model`` field ("name@N" for tenants)
    lora_key: str | None  # the adapter's content hash in the engine; None = the base model
    cache_extra_keys: tuple[str, ...] = ()  # join the request's prefix-cache block hashes
    adapter_version_id: int | None = None  # the registry's AdapterVersion (usage rows)
    # Makes the engine hold the adapter (the registry's load of a cold version, an operator
    # adapter from --lora-resolver-dir); None: nothing to do. Called after admission, never by
    # the resolver. It returns the adapter's engine key where ``lora_key`` could not be known
    # before the load (a directory's content hash), else None.
    load: Callable[[], Awaitable[str | None]] | None = field(
        default=None, compare=False, repr=False
    )

    async def prepare(self) -> ResolvedModel:
        """Make the model usable by the engine (loads a cold adapter; may raise ``APIError``
        or ``EngineDeadError``); returns the model to submit, its ``lora_key`` known."""
        if self.load is None:
            return self
        key = await self.load()
        if key is None or key == self.lora_key:
            return self
        return dataclasses.replace(self, lora_key=key, load=None)


def adapter_failed(served_name: str, cause: str) -> APIError:
    """422 ``adapter_failed``: the adapter version ``served_name`` (``name@N``, as the tenant
    knows it: never the engine's key or a path) could not be loaded, for ``cause``; it fails
    until it is uploaded again or the operator retries it."""
    return APIError(
        422,
        f"The adapter {served_name} could not be loaded: {cause}. Upload the adapter again "
        "as a new version, or ask the operator to retry it; other models are unaffected.",
        param="model",
        code="adapter_failed",
    )


@dataclass(frozen=True)
class ModelEntry:
    name: str
    created: int
    parent: str | None  # the base model's served name, for adapters
    adapter: AdapterInfo | None = None
    owned_by: str = "loraplex"  # the tenant's name, for a tenant's adapters


class TenantModels(Protocol):
    """The models of tenant callers (``caller.tenant_id`` set): the adapter registry."""

    async def resolve(self, caller: Caller, name: str) -> ResolvedModel | None:
        """The caller's adapter ``name`` / ``name@N``; None when the caller has none such."""
        ...

    async def list_models(self, caller: Caller) -> list[ModelEntry]:
        """The caller's adapters (never the base model, never another tenant's)."""
        ...


@dataclass(frozen=True)
class ServedName:
    """The base model's name in the API: the operator's ``--served-model-name``, else the
    model directory's name, which the engine tells once it has started."""

    configured: str | None
    client: EngineClient

    def __call__(self) -> str:
        return self.configured or Path(self.client.info.model_dir).name or "model"


class ModelResolver:
    def __init__(
        self,
        base_name: Callable[[], str],
        *,
        tenant_models: TenantModels | None = None,
        share_base_prefix_cache: bool = False,
    ) -> None:
        """``tenant_models``: the registry, on the platform; ``share_base_prefix_cache``:
        tenants' base-model requests share KV blocks."""
        self._base_name = base_name
        self._created = int(time.time())
        self._adapters: dict[str, ModelEntry] = {}
        self._aliases: list[str] = []  # more names of the base model (--served-model-name a b)
        # The operator's adapters found on demand (--lora-resolver-dir): a name no adapter has
        # -> a model whose ``load`` validates and loads it after admission; None: not there.
        self.directory: Callable[[Caller, str], ResolvedModel | None] | None = None
        self.lock = asyncio.Lock()  # held while the adapter set changes (load / unload)
        self.tenant_models = tenant_models
        self.share_base_prefix_cache = share_base_prefix_cache

    @property
    def base_name(self) -> str:
        return self._base_name()

    def is_base(self, name: str) -> bool:
        """Whether ``name`` names the base model (its served name or an alias)."""
        return name == self.base_name or name in self._aliases

    def add_base_alias(self, name: str) -> None:
        """One more name of the base model (vLLM's several ``--served-model-name`` values):
        requests may use it, /v1/models lists it, responses echo the first name."""
        self.check_new_name(name)
        self._aliases.append(name)

    async def lookup(self, caller: Caller, name: str) -> ResolvedModel:
        """The model ``name`` as ``caller`` may use it; 404 ``model_not_found`` otherwise.
        A name outside the caller's key allowlist is refused before any lookup, with the
        same 404 as a missing model: the answer never depends on what exists."""
        if not allows(caller.allowed_models, name):
            raise model_not_found(name)
        if self.is_base(name):
            return self._base(caller)
        if caller.tenant_id is not None and self.tenant_models is not None:
            found = await self.tenant_models.resolve(caller, name)
            if found is None:
                raise model_not_found(name)
            return found
        return self.resolve(caller, name)

    async def models(self, caller: Caller) -> list[ModelEntry]:
        """What ``caller`` may use: the base model first, then adapters by name (within the
        key's allowlist)."""
        if caller.tenant_id is not None and self.tenant_models is not None:
            entries = [*self._base_entries(), *await self.tenant_models.list_models(caller)]
        else:
            entries = self.list_models(caller)
        return [e for e in entries if allows(caller.allowed_models, e.name)]

    def _base(self, caller: Caller) -> ResolvedModel:
        keys = () if self.share_base_prefix_cache else caller.cache_extra_keys
        return ResolvedModel(self.base_name, None, keys)

    def resolve(self, caller: Caller, name: str) -> ResolvedModel:
        """The operator's models only (synchronous; see ``lookup``)."""
        if self.is_base(name):
            return self._base(caller)
        entry = self._adapters.get(name)
        if entry is None or entry.adapter is None:
            found = self.directory(caller, name) if self.directory is not None else None
            if found is None:
                raise model_not_found(name)
            return found
        return ResolvedModel(entry.name, entry.adapter.key, caller.cache_extra_keys)

    def list_models(self, caller: Caller) -> list[ModelEntry]:
        return [*self._base_entries(), *sorted(self._adapters.values(), key=lambda e: e.name)]

    def _base_entries(self) -> list[ModelEntry]:
        """The base model under its served name, then under each alias."""
        return [ModelEntry(n, self._created, None) for n in (self.base_name, *self._aliases)]

    def get_adapter(self, caller: Caller, name: str) -> ModelEntry | None:
        return self._adapters.get(name)

    def check_new_name(self, name: str) -> None:
        """Raise 400 when ``name`` cannot name a new adapter (taken, or the base model's)."""
        if self.is_base(name):
            raise APIError(
                400,
                f"{name!r} is the base model's name; choose another name for the adapter.",
                param="lora_name",
                code="adapter_name_taken",
            )
        if name in self._adapters:
            raise APIError(
                400,
                f"An adapter named {name!r} is already loaded; unload it first, or choose "
                "another name.",
                param="lora_name",
                code="adapter_name_taken",
            )

    def add_adapter(self, info: AdapterInfo, *, alias: bool = False) -> ModelEntry:
        """``alias``: the weights may already be loaded under another name (KServe's
        ``--lora-modules`` names each adapter twice); else that is refused."""
        self.check_new_name(info.name)
        for other in () if alias else self._adapters.values():
            if other.adapter is not None and other.adapter.key == info.key:
                raise APIError(
                    400,
                    f"These adapter weights are already loaded as {other.name!r}; use that name.",
                    param="lora_path",
                    code="adapter_exists",
                )
        entry = ModelEntry(info.name, int(time.time()), self.base_name, info)
        self._adapters[info.name] = entry
        return entry

    def remove_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)

    def names_of(self, key: str) -> list[str]:
        """The operator's adapter names whose weights are ``key``."""
        return [n for n, e in self._adapters.items() if e.adapter and e.adapter.key == key]
