"""Which adapters hold the ``max_loras`` step slots. Pure Python, owned by the scheduler.

A slot is a row of the adapter pool's page index (``kernels/lora_weights.py``), not memory: it
names one adapter for the step's kernels. A slot is held while at least one running request uses
its adapter, so one step never needs more than ``max_loras`` adapters. A released slot remembers its last adapter: when that adapter
comes back it gets the same slot and the runner does not rewrite its page-index row. Free slots are
reused least-recently-released first.
"""

from __future__ import annotations

from collections import OrderedDict


class LoRASlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._slot_of: dict[str, int] = {}  # adapter key -> slot, for adapters in use
        self._users: dict[str, int] = {}  # adapter key -> running requests using it
        self._last_key: dict[int, str] = {}  # slot -> the adapter it held last
        self._free: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))

    def slot_of(self, key: str | None) -> int:
        return -1 if key is None else self._slot_of[key]

    def can_acquire(self, key: str | None) -> bool:
        return key is None or key in self._slot_of or bool(self._free)

    def holds(self, key: str) -> bool:
        """Whether ``key`` holds a slot (has running requests)."""
        return key in self._slot_of

    def is_resident(self, key: str | None) -> bool:
        return key is None or key in self._slot_of

    def acquire(self, key: str | None) -> int:
        if key is None:
            return -1
        if key not in self._slot_of:
            slot = next((s for s in self._free if self._last_key.get(s) == key), None)
            if slot is None:
                slot = next(iter(self._free))
            del self._free[slot]
            self._slot_of[key] = slot
            self._last_key[slot] = key
        self._users[key] = self._users.get(key, 0) + 1
        return self._slot_of[key]

    def release(self, key: str | None) -> None:
        if key is None:
            return
        self._users[key] -= 1
        if self._users[key] == 0:
            del self._users[key]
            self._free[self._slot_of.pop(key)] = None

    def in_use(self) -> dict[int, str]:
        return {slot: key for key, slot in self._slot_of.items()}
