"""The two Hugging Face + PEFT baselines of the multi-adapter benchmark.

One ``PeftModel`` holds all N adapters (``load_adapter`` each). Both baselines use static,
left-padded ``generate()`` batches that run until their longest request is done; only each
request's own tokens count as output.

* ``peft_static``: per-adapter batches. For each adapter, ``set_adapter(name)``, then its requests
  (workload order) in batches of ``--hf-batch-size``.
* ``peft_mixed``: PEFT's mixed-adapter batches, ``generate(..., adapter_names=[...])``, the
  workload in order, in batches of ``--peft-mixed-batch-size``.

Subset (``--hf-max-requests M``): a baseline runs **whole batches of its full-workload plan**, so
batch sizes and padding are those the full run would have: at most M requests, but at least one
batch (a mixed batch larger than M runs whole). Static batches are visited round-robin across
adapters (adapter 0's first batch, adapter 1's first, ...) and taken while they fit, so the
subset spreads over several adapters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from loraplex.bench.systems import RunResult, generate_padded, pad_token_id, torch_dtype
from loraplex.config import DType

PeftMode = Literal["peft_static", "peft_mixed"]


@dataclass(frozen=True)
class Batch:
    """One ``generate()`` call: workload indices and the adapter name of each row."""

    requests: tuple[int, ...]
    adapters: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.requests or len(self.requests) != len(self.adapters):
            raise ValueError("a batch needs one adapter name per request, and at least one request")

    def steps(self, output_lens: Sequence[int]) -> int:
        """Decode length of the batch: its longest request."""
        return max(output_lens[i] for i in self.requests)


def static_plan(adapter_of: Sequence[str], batch_size: int) -> list[Batch]:
    """Per-adapter batches: adapters in first-appearance order, each one's requests in order."""
    by_adapter: dict[str, list[int]] = {}
    for i, name in enumerate(adapter_of):
        by_adapter.setdefault(name, []).append(i)
    plan = []
    for name, idx in by_adapter.items():
        for s in range(0, len(idx), batch_size):
            chunk = tuple(idx[s : s + batch_size])
            plan.append(Batch(chunk, (name,) * len(chunk)))
    return plan


def mixed_plan(adapter_of: Sequence[str], batch_size: int) -> list[Batch]:
    """Mixed-adapter batches: the workload in order, ``batch_size`` requests at a time."""
    n = len(adapter_of)
    return [
        Batch(tuple(range(s, min(s + batch_size, n))), tuple(adapter_of[s : s + batch_size]))
        for s in range(0, n, batch_size)
    ]


def select_batches(
    plan: Sequence[Batch], max_requests: int | None, *, by_adapter: bool
) -> list[Batch]:
    """Whole batches of ``plan`` holding at most ``max_requests`` requests (all for None), but
    never fewer than one batch. ``by_adapter``: visit per-adapter batches round-robin over the
    adapters (each adapter's first batch, then its second, ...), else in plan order; a batch is
    taken when it still fits. Plan order is kept."""
    if max_requests is None or max_requests >= sum(len(b.requests) for b in plan):
        return list(plan)
    groups: dict[str, list[int]] = {}  # plan positions of each adapter's batches
    for n, b in enumerate(plan):
        groups.setdefault(b.adapters[0] if by_adapter else "", []).append(n)
    depth = max(len(q) for q in groups.values())
    visit = [q[d] for d in range(depth) for q in groups.values() if d < len(q)]
    chosen = [visit[0]]
    total = len(plan[visit[0]].requests)
    for n in visit[1:]:
        if total + len(plan[n].requests) <= max_requests:
            chosen.append(n)
            total += len(plan[n].requests)
    return [plan[n] for n in sorted(chosen)]


def padding_efficiency(batches: Sequence[Batch], output_lens: Sequence[int]) -> float:
    """Requested output tokens over decoded rows × steps (1.0: no batch waits on a longer row)."""
    useful = sum(output_lens[i] for b in batches for i in b.requests)
    decoded = sum(len(b.requests) * b.steps(output_lens) for b in batches)
    return useful / decoded if decoded else 0.0


def describe(batches: Sequence[Batch], output_lens: Sequence[int]) -> dict[str, Any]:
    return {
        "batches": len(batches),
        "requests": sum(len(b.requests) for b in batches),
        "batch_sizes": [len(b.requests) for b in batches],
        "adapters_covered": len({a for b in batches for a in b.adapters}),
        "padding_efficiency": round(padding_efficiency(batches, output_lens), 4),
    }


class PeftBaselines:
    """Base model + ``PeftModel`` with every adapter loaded; runs static or mixed batches."""

    def __init__(self, model_dir: str, dtype: DType, adapters: dict[str, str]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        if not adapters:
            raise ValueError("the PEFT baselines need at least one adapter")
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype))
        names = list(adapters)
        model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(adapters[name], adapter_name=name)
        self.model = model.eval()
        self.pad_id = pad_token_id(base)
        self.names = names

    def warm_up(self, prompts: Sequence[list[int]]) -> None:
        sample = [list(p) for p in prompts[:2]]
        self.model.set_adapter(self.names[0])
        generate_padded(self.model, self.pad_id, sample, 4)
        mixed = [self.names[i % len(self.names)] for i in range(len(sample))]
        generate_padded(self.model, self.pad_id, sample, 4, adapter_names=mixed)

    def run(
        self,
        mode: PeftMode,
        batches: Sequence[Batch],
        prompts: Sequence[list[int]],
        output_lens: Sequence[int],
        repeat: int,
    ) -> RunResult:
        indices: list[int] = []
        outputs: list[list[int]] = []
        start = time.perf_counter()
        for b in batches:
            rows = [list(prompts[i]) for i in b.requests]
            steps = b.steps(output_lens)
            if mode == "peft_static":
                self.model.set_adapter(b.adapters[0])
                got = generate_padded(self.model, self.pad_id, rows, steps)
            else:
                got = generate_padded(
                    self.model, self.pad_id, rows, steps, adapter_names=list(b.adapters)
                )
            for i, row in zip(b.requests, got, strict=True):
                indices.append(i)
                outputs.append(row[: output_lens[i]])  # only the request's own tokens count
        seconds = time.perf_counter() - start
        return RunResult(
            system=mode,
            repeat=repeat,
            seconds=seconds,
            output_tokens=sum(len(o) for o in outputs),
            num_requests=len(outputs),
            outputs=outputs,
            indices=indices,
        )
