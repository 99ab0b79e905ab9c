"""A torch-free stand-in for the runner's adapter store: it carries out ``AdapterPlan``s as the
real one does (copies finish a few steps later, on a "device" whose pages remember which
adapter was written into them) and checks, every step, that each request reads pages holding
its own adapter. Wraps ``FakeRunner``."""

from __future__ import annotations

from collections.abc import Callable

from loraplex.engine.records import RunnerOutput, SchedulerOutput
from loraplex.lora.plan import LoadOrder, LoadResult
from tests.utils.fake_runner import FakeRunner


class FakeCopier:
    """``delay``: steps a copy takes; ``fail(key)``: the error a copy of ``key`` ends with
    (None: it succeeds)."""

    def __init__(
        self, runner: FakeRunner, delay: int = 1, fail: Callable[[str], str | None] | None = None
    ) -> None:
        self.runner = runner
        self.delay = delay
        self.fail = fail or (lambda key: None)
        self.pages: dict[tuple[str, int], str] = {}  # (module, page) -> adapter written there
        self.writing: dict[tuple[str, int], str] = {}  # pages a copy in flight is writing
        self.in_flight: list[tuple[int, LoadOrder]] = []  # (steps left, order)
        self.slots: dict[int, tuple[str, int]] = {}  # slot -> (key, generation)
        self.loads: list[str] = []  # every copy started, in order
        self.steps = 0
        self.max_in_flight = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        plan = out.lora_plan
        if plan is not None:
            for order in plan.loads:
                for module, rows in order.pages.items():
                    for p in rows:
                        owner = self.writing.get((module, p))
                        assert owner is None, f"page {module}:{p} handed out while {owner} loads"
                        self.writing[(module, p)] = order.key
                self.in_flight.append((self.delay, order))
                self.loads.append(order.key)
            for slot, b in plan.slots.items():
                for module, rows in b.pages.items():
                    for p in rows:
                        held = self.pages.get((module, p))
                        assert held == b.key, f"slot {slot} -> {b.key}: page {p} holds {held}"
                self.slots[slot] = (b.key, b.generation)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        for s in out.requests:
            if s.lora_slot >= 0:
                key = out.lora_slots[s.lora_slot]
                assert self.slots[s.lora_slot][0] == key, "a request reads another adapter's slot"
        result = self.runner.execute(out)
        done: list[LoadResult] = []
        left: list[tuple[int, LoadOrder]] = []
        for steps, order in self.in_flight:
            if steps > 1:
                left.append((steps - 1, order))
                continue
            error = self.fail(order.key)
            for module, rows in order.pages.items():
                for p in rows:
                    del self.writing[(module, p)]
                    if error is None:
                        self.pages[(module, p)] = order.key
                    else:
                        self.pages.pop((module, p), None)
            done.append(LoadResult(order.key, order.generation, error=error))
        self.in_flight = left
        result.lora_loads = done
        return result
