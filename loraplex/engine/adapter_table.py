"""Who holds each adapter the engine has loaded, and when its engine copy may go.

The engine keys an adapter by its content hash, so equal adapters of several owners (the
operator's ``--lora-modules``, the registry's versions of any tenant) share one engine copy. The
copy is reference-counted by owner: releasing one owner's reference leaves it loaded for the
others, and the last release removes it only once no in-flight request uses it (until then it is
*retiring*: no new request may use it, running ones finish). A re-add or a retain by any owner
before that cancels the removal.

Each owner loaded the adapter from its own path; the engine reads one of them (``source``: it
re-reads it after a host-memory eviction or an engine restart). When the owner of the source
path lets go while others stay, the engine must be pointed at another owner's path first
(``Release.repoint``), so that no owner's files are read after that owner removed them.

Pure bookkeeping, on the client's event loop; the client does the engine calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from loraplex.engine.info import AdapterInfo

OPERATOR_OWNER = "operator"  # adapters the operator loads (--lora-modules, /v1/load_lora_adapter)


@dataclass
class HeldAdapter:
    info: AdapterInfo
    name: str
    pinned: bool
    source: str  # the path the engine reads this adapter from
    paths: dict[str, str]  # owner -> the path it loaded the adapter from; empty: retiring
    users: int = 0  # in-flight requests on this adapter
    retiring: asyncio.Future[bool] | None = None  # resolves when the copy goes (or is kept)


@dataclass(frozen=True)
class Release:
    """What releasing one owner's reference asks of the client."""

    removed: asyncio.Future[bool]  # True once the engine copy is gone; False if it is kept
    remove_now: bool = False  # no owner and no request left: remove it from the engine now
    repoint: str | None = None  # the engine must read the adapter from this path from now on


@dataclass
class AdapterTable:
    _held: dict[str, HeldAdapter] = field(default_factory=dict)

    def get(self, key: str) -> HeldAdapter | None:
        return self._held.get(key)

    def usable(self, key: str) -> bool:
        """Whether new requests may use ``key``: some owner holds it."""
        held = self._held.get(key)
        return held is not None and bool(held.paths)

    def owners(self, key: str) -> frozenset[str]:
        held = self._held.get(key)
        return frozenset(held.paths) if held is not None else frozenset()

    def keys_of(self, owner: str) -> list[str]:
        return [key for key, held in self._held.items() if owner in held.paths]

    def held(self) -> list[HeldAdapter]:
        """Adapters some owner holds (what an engine restart loads again)."""
        return [held for held in self._held.values() if held.paths]

    def record(self, info: AdapterInfo, name: str, path: str, pinned: bool, owner: str) -> None:
        """The engine loaded ``info`` from ``path`` for ``owner`` (and now reads that path)."""
        held = self._held.get(info.key)
        if held is None:
            self._held[info.key] = HeldAdapter(info, name, pinned, path, {owner: path})
            return
        held.paths[owner] = path
        held.source = path
        held.pinned = held.pinned or pinned
        self._keep(held)

    def retain(self, key: str, owner: str, path: str) -> bool:
        """Add ``owner``'s reference to a copy the engine holds (no engine call needed); False
        when the engine does not hold ``key`` for anyone (load it with ``add_lora``)."""
        held = self._held.get(key)
        if held is None or (not held.paths and held.retiring is None):
            return False
        held.paths.setdefault(owner, path)
        self._keep(held)
        return True

    def release(self, key: str, owner: str) -> Release:
        held = self._held.get(key)
        if held is None or owner not in held.paths:
            return Release(_resolved(held is None))
        del held.paths[owner]
        if held.paths:
            future = _resolved(False)
            if held.source not in held.paths.values():
                held.source = next(iter(held.paths.values()))
                return Release(future, repoint=held.source)
            return Release(future)
        if held.retiring is None:
            held.retiring = asyncio.get_running_loop().create_future()
        return Release(held.retiring, remove_now=held.users == 0)

    def started(self, key: str) -> None:
        held = self._held.get(key)
        if held is not None:
            held.users += 1

    def ended(self, key: str) -> bool:
        """A request on ``key`` ended; True when the copy is now due for removal."""
        held = self._held.get(key)
        if held is None:
            return False
        held.users = max(0, held.users - 1)
        return held.users == 0 and not held.paths

    def removal_due(self, key: str) -> bool:
        held = self._held.get(key)
        return held is not None and not held.paths and held.users == 0

    def drop(self, key: str) -> None:
        """The engine no longer holds ``key`` (removed, or lost with a restart)."""
        held = self._held.pop(key, None)
        if held is not None and held.retiring is not None and not held.retiring.done():
            held.retiring.set_result(True)

    def drop_unowned(self) -> None:
        """A new engine process holds only what some owner holds: retiring copies are gone."""
        for key in [key for key, held in self._held.items() if not held.paths]:
            self.drop(key)

    @staticmethod
    def _keep(held: HeldAdapter) -> None:
        if held.retiring is not None:
            if not held.retiring.done():
                held.retiring.set_result(False)
            held.retiring = None


def _resolved(value: bool) -> asyncio.Future[bool]:
    future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future
