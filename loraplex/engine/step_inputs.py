"""What rank 0 sends the other tensor-parallel ranks each step: only what their forward needs.

A ``SchedulerOutput`` carries sampling parameters, whole prompts and outputs (for penalties)
and structured-output masks, which only rank 0 (the sampler) reads. ``StepInputs`` keeps the
per-request fields that shape the flat batch (tokens, positions, block tables, adapter slots),
in the runner's row order, plus which rows sample, the block copies and rank 0's adapter-pool
decisions since the last step. Pickled once per step and sent to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.records import ScheduledRequest, SchedulerOutput
from loraplex.lora.replica import PoolEvent


@dataclass(slots=True)
class StepRequest:
    """One request's rows of the step (``ScheduledRequest`` without what only sampling reads)."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    lora_slot: int
    num_drafts: int


@dataclass
class StepInputs:
    requests: list[StepRequest]  # in the runner's row order
    fork_parents: list[str]  # each fork samples from its parent's last row
    blocks_to_copy: list[tuple[int, int]]
    lora_events: list[PoolEvent] = field(default_factory=list)

    @classmethod
    def of(
        cls, out: SchedulerOutput, reqs: list[ScheduledRequest], events: list[PoolEvent]
    ) -> StepInputs:
        """The inputs of ``out`` with its requests in row order ``reqs``."""
        return cls(
            requests=[
                StepRequest(
                    r.request_id,
                    r.token_ids,
                    r.start_pos,
                    r.block_table,
                    r.sample,
                    r.lora_slot,
                    len(r.draft_token_ids),
                )
                for r in reqs
            ],
            fork_parents=[f.parent_id for f in out.forks],
            blocks_to_copy=list(out.blocks_to_copy),
            lora_events=events,
        )

    def sample_index(self, last_rows: list[int]) -> list[int]:
        """The hidden rows the step computes logits for, in rank 0's sampling order: each
        sampling request's last ``1 + drafts`` rows, then each fork's parent's last row."""
        index: list[int] = []
        row_of: dict[str, int] = {}
        for r, last in zip(self.requests, last_rows, strict=True):
            row_of[r.request_id] = last
            if r.sample:
                index.extend(range(last - r.num_drafts, last + 1))
        index.extend(row_of[p] for p in self.fork_parents)
        return index
