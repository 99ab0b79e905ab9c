"""Which model a request's ``model`` field names: the base model, or a loaded adapter.

For now adapters are loaded by the operator (``/v1/load_lora_adapter``) and visible to every
caller. With tenancy, ``list_models`` and ``resolve`` filter by ``caller.tenant_id`` here, in this
one place, and another tenant's adapter is answered exactly like a missing one (404
``model_not_found``). Filesystem paths never leave this module's callers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loraplex.engine.client import AdapterInfo
from loraplex.platform.auth import Caller
from loraplex.platform.openai.errors import APIError, model_not_found


@dataclass(frozen=True)
class ResolvedModel:
    served_name: str  # what responses echo in their ``model`` field
    lora_key: str | None  # the adapter's content hash in the engine; None = the base model


@dataclass(frozen=True)
class ModelEntry:
    name: str
    created: int
    parent: str | None  # the base model's served name, for adapters
    adapter: AdapterInfo | None = None


class ModelResolver:
    def __init__(self, base_name: str) -> None:
        self.base_name = base_name  # set before serving (the app's lifespan may set it late)
        self._created = int(time.time())
        self._adapters: dict[str, ModelEntry] = {}
        self.lock = asyncio.Lock()  # held while the adapter set changes (load / unload)

    def resolve(self, caller: Caller, name: str) -> ResolvedModel:
        if name == self.base_name:
            return ResolvedModel(self.base_name, None)
        entry = self._adapters.get(name)
        if entry is None or entry.adapter is None:
            raise model_not_found(name)
        return ResolvedModel(entry.name, entry.adapter.key)

    def list_models(self, caller: Caller) -> list[ModelEntry]:
        base = ModelEntry(self.base_name, self._created, None)
        return [base, *sorted(self._adapters.values(), key=lambda e: e.name)]

    def get_adapter(self, caller: Caller, name: str) -> ModelEntry | None:
        return self._adapters.get(name)

    def check_new_name(self, name: str) -> None:
        """Raise 400 when ``name`` cannot name a new adapter (taken, or the base model's)."""
        if name == self.base_name:
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

    def add_adapter(self, info: AdapterInfo) -> ModelEntry:
        self.check_new_name(info.name)
        for other in self._adapters.values():
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
