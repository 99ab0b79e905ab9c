"""Drive a bare ``ModelRunner``'s adapters as the engine core does: a real ``AdapterResidency``
decides, the runner's store copies. For tests that call ``runner.execute`` without a scheduler."""

from __future__ import annotations

import dataclasses

from loraplex.engine.adapter_residency import AdapterResidency
from loraplex.engine.records import SchedulerOutput
from loraplex.engine.runner import ModelRunner


class Planner:
    def __init__(self, runner: ModelRunner) -> None:
        assert runner.lora is not None
        self.runner = runner
        self.residency = AdapterResidency(
            runner.lora.pages_per_module(), max_cpu_loras=64, max_loras=runner.lora.config.max_loras
        )

    def add(self, path: str, name: str) -> str:
        """Add an adapter; its key (content hash)."""
        assert self.runner.lora is not None
        _, reg = self.runner.lora.add_adapter(path, name)
        self.residency.register(reg.key, name, reg.ranks, reg.nbytes)
        return reg.key

    def plan(self, out: SchedulerOutput) -> SchedulerOutput:
        """``out`` with the plan residency gives for its slots; adapters not in the pool are
        copied in first, on this thread."""
        store = self.runner.lora
        assert store is not None
        for key in out.lora_slots.values():
            order = self.residency.reserve_now(key, set(out.lora_slots.values()).__contains__)
            if order is not None:
                self.residency.loaded(store.load_now(order))
        plan = self.residency.plan_step(out.lora_slots)
        return dataclasses.replace(out, lora_plan=plan)
