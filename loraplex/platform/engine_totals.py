"""Engine totals that never go backwards: the engine process counts from zero again after a
restart, so each total carries an offset (``MonotonicTotals``), for ``/metrics``."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class MonotonicTotals(Generic[K]):
    """Engine totals made monotonic across engine restarts: ``total = value + offset``, the
    offset growing by the last value seen before each reset. Keys are any hashable names (an
    engine counter, or a tenant's counter as ``(tenant, field)``)."""

    def __init__(self) -> None:
        self._last: dict[K, float] = {}
        self._offset: dict[K, float] = {}
        self._restarts: int | None = None

    def update(self, values: Mapping[K, float], restarts: int) -> None:
        """The engine's current totals; ``restarts``: its ``engine_restarts`` (a change of it
        is a reset even where a total did not go down)."""
        restarted = self._restarts is not None and restarts != self._restarts
        self._restarts = restarts
        for key, value in values.items():
            last = self._last.get(key)
            if last is not None and (restarted or value < last):
                self._offset[key] = self._offset.get(key, 0.0) + last
            self._last[key] = value

    def total(self, key: K) -> float | None:
        last = self._last.get(key)
        return None if last is None else last + self._offset.get(key, 0.0)

    def forget(self, keys: Iterable[K]) -> None:
        """Drop these totals (a deleted tenant's): a key seen again starts from zero."""
        for key in keys:
            self._last.pop(key, None)
            self._offset.pop(key, None)

    def counted(self) -> list[K]:
        """Every key with a total."""
        return list(self._last)
