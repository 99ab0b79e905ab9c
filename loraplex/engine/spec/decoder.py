"""The speculative-decoding component of the engine core: after each step it counts what the
step verified, then asks the proposer for the next step's drafts. Pure Python (a draft model
proposer brings torch with it).

Which requests draft: running ones in their decode phase (a token generated, every token but
the last computed), with no structured-output constraint (its grammar mask covers the next
position only, so constrained requests decode one token per step), and not in a step where
more requests are decoding than the policy allows (``policy.py``). Prefill chunks, requests
waiting after a preemption, and samples of an ``n > 1`` request before their fork never draft;
each sample drafts on its own after it.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.engine.info import SpecDecodeStats
from loraplex.engine.records import EngineCoreOutput, RunnerOutput, SchedulerOutput
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.spec.policy import DraftPolicy
from loraplex.engine.spec.proposer import Proposer


class SpecDecoder:
    def __init__(self, proposer: Proposer, policy: DraftPolicy, max_model_len: int) -> None:
        self.proposer = proposer
        self.policy = policy
        self.max_model_len = max_model_len
        self.num_verifications = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0
        self.num_steps_off = 0
        self.accepted_per_position = [0] * policy.max_drafts

    def after_step(
        self,
        out: SchedulerOutput,
        result: RunnerOutput,
        outputs: Sequence[EngineCoreOutput],
        running: Sequence[Request],
    ) -> None:
        """Count the step's verifications, then set each running request's drafts."""
        if out.finished_request_ids:
            self.proposer.forget(out.finished_request_ids)
            self.policy.forget(out.finished_request_ids)
        self._count(out, result, outputs)
        self.propose(running)

    def _count(
        self, out: SchedulerOutput, result: RunnerOutput, outputs: Sequence[EngineCoreOutput]
    ) -> None:
        emitted: dict[str, int] | None = None
        for s in out.requests:
            drafts = s.draft_token_ids
            if not drafts:
                continue
            if emitted is None:
                emitted = {o.request_id: len(o.new_token_ids) for o in outputs}
            accepted = len(result.sampled[s.request_id]) - 1
            self.num_verifications += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            self.num_emitted_tokens += emitted.get(s.request_id, 0)
            for j in range(accepted):
                self.accepted_per_position[j] += 1
            self.policy.observe(s.request_id, len(drafts), accepted)

    def propose(self, running: Sequence[Request]) -> None:
        """Set the drafts of the running requests for the next step (none where the policy or
        the proposer gives none: drafts left from a step that did not schedule a request are
        dropped too)."""
        for r in running:
            if r.draft_token_ids:
                r.draft_token_ids = []
        decoding = [r for r in running if _decoding(r)]
        if not decoding:
            return
        if not self.policy.step_speculates(len(decoding)):
            self.num_steps_off += 1
            return
        reqs: list[Request] = []
        ks: list[int] = []
        for r in decoding:
            if r.params.structured_outputs is not None:
                continue
            k = self.policy.num_drafts(r.request_id, len(decoding))
            k = min(k, self.max_model_len - r.num_tokens)
            if r.params.max_tokens is not None:  # the step emits one token beyond the drafts
                k = min(k, r.params.max_tokens - r.num_output_tokens - 1)
            if k > 0:
                reqs.append(r)
                ks.append(k)
        if not reqs:
            return
        for r, k, drafts in zip(reqs, ks, self.proposer.propose(reqs, ks), strict=True):
            r.draft_token_ids = drafts[:k]

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            method=self.proposer.name,
            num_speculative_tokens=self.policy.max_drafts,
            disable_by_batch_size=self.policy.disable_by_batch_size,
            num_verifications=self.num_verifications,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_emitted_tokens=self.num_emitted_tokens,
            num_steps_off=self.num_steps_off,
            accepted_per_position=tuple(self.accepted_per_position),
        )


def _decoding(r: Request) -> bool:
    return (
        r.status == RequestStatus.RUNNING
        and r.num_output_tokens > 0
        and r.num_computed_tokens == r.num_tokens - 1
    )
