"""Continuous-batching scheduler: schedules tokens, not phases. Pure Python, no torch.

Every request catches its ``num_computed_tokens`` up to ``num_tokens``. One step takes running
requests first (decodes and unfinished prefill chunks, oldest first), then admits waiting ones in
the order of the scheduling policy (``WaitingQueue``; FCFS by default), within
``max_num_batched_tokens`` tokens and ``max_num_seqs`` requests. A prompt longer than the
remaining budget is split into chunks over several steps (chunked prefill). When the KV pool runs
dry, the policy's victim (FCFS: the newest running request) is preempted: its blocks are freed and
it goes back to the front of the waiting queue, to be recomputed later (its generated tokens are
kept).

With multi-LoRA, a step uses at most ``max_loras`` adapters (step slots, ``LoRASlots``), and a
request is admitted only when its adapter is ``Ready`` in the device pool
(``engine/adapter_residency.py``: a miss notes the demand, the load starts in the background
once admission is done, and the request waits, so no step stalls on a copy); which waiting
adapter request may pass another that is not ready is the policy's rule (``FCFSQueue``:
skipped, with a bound on how long a cold adapter waits). The step's adapter plan (loads to
start, slot rows to point) goes to the runner in ``SchedulerOutput.lora_plan``; finished copies
come back in ``RunnerOutput.lora_loads``. A request whose adapter ``Failed`` ends alone with
``finish_reason`` "error" and the reason (``error_code`` "adapter_failed"); the step goes on.
Adapter loads are charged to the tenant that caused them (``WaitingQueue.charge_work``).

Priority preemption (policies "priority" and "fair"): when the request the policy would admit
next finds no seat (``max_num_seqs``) or no KV room, running requests the policy names
(``admission_victims``: of a strictly worse priority; "fair" also names, among requests of
the same priority, those of tenants holding more than their share of the seats) are marked,
enough of them to make the room, and preempted at the start of the next step, before anything
is scheduled. Not at once:
a request already scheduled this step has its blocks registered in the prefix cache for tokens
computed in this step, which another request may already have hit.

Each step's service (prompt tokens computed, tokens generated) is counted per tenant
(``SchedulerStats.tenants``) and charged to the policy (``WaitingQueue.charge``), whose tenant
weights ``set_tenant_weights`` replaces from the next step on.

The n samples of one request share the prompt's KV: the first sample (the leader) prefills the
prompt; in the step that finishes the prompt, the others are forked from it (block tables shared
by reference) and sample their first token from the leader's last row.

Structured output: a request with a constraint reaches the scheduler once its grammar is
compiled (``engine/structured.py`` holds it until then). ``update`` reports each of its tokens
to ``TokenConstraints.advance`` after the EOS and stop-token checks and before the length check:
a constraint completed by the last allowed token is a "stop", one that fails ends that request
alone with status ``FINISHED_ERROR``.

Speculative decoding (``engine/spec/``): a decoding request may carry draft tokens
(``Request.draft_token_ids``, set after ``update``); it is scheduled with them, within the token
budget, and gets KV room for them (never registered in the prefix cache); when blocks are short
its drafts are dropped before anyone is preempted. ``update`` appends the tokens the runner
accepted and trims the rejected drafts' KV through ``rollback``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.config import SchedulerConfig
from loraplex.engine.adapter_residency import AdapterResidency, Failed, Ready, Tenant
from loraplex.engine.admission import Service, TenantSlots, check_tenant_weights
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.lora_slots import LoRASlots
from loraplex.engine.records import (
    EngineCoreOutput,
    ForkedSample,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.waiting_queue import WaitingQueue, make_waiting_queue


@dataclass
class TenantUsage:
    """One tenant's service since the scheduler started."""

    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_prompt_tokens_computed: int = 0  # prefill tokens actually run through the model
    num_generated_tokens: int = 0
    tenants: dict[str | None, TenantUsage] = field(default_factory=dict)  # None: no tenant


class TokenConstraints(Protocol):
    """Structured output as the scheduler sees it (``engine/structured.py``): each generated
    token of a constrained request is reported, and the constraint says when it is done."""

    def advance(self, req: Request, token_id: int) -> bool:
        """``req`` (with a constraint) generated ``token_id``: True when the constraint is
        complete (the request stops). Raises when the constraint refuses the token or fails:
        the scheduler then ends that request alone (finish_reason "error")."""
        ...

    def rollback(self, req: Request, num_tokens: int) -> None:
        """``req`` forgets its last ``num_tokens`` output tokens."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted."""
        ...


# An adapter load is charged as this many bytes per token of service (fair policy): a cold
# rank-64 q/v adapter of SmolLM2 (about 7 MB) costs about as much as a 50-token prompt.
LOAD_BYTES_PER_TOKEN = 1 << 17
ADAPTER_FAILED = "adapter_failed"


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        max_loras: int = 1,
        waiting_queue: WaitingQueue | None = None,
        constraints: TokenConstraints | None = None,
        residency: AdapterResidency | None = None,
    ):
        self.config = config
        self.kv = kv
        # the step slots are residency's when there is one (it owns everything adapter)
        self.slots = residency.slots if residency is not None else LoRASlots(max_loras)
        if self.slots.max_loras != max_loras:
            raise ValueError(
                f"max_loras={max_loras} but the adapter residency has {self.slots.max_loras} "
                "slots; build both from the same LoRAConfig"
            )
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        if waiting_queue is None:  # not ``or``: an empty queue is falsy
            waiting_queue = make_waiting_queue(config.scheduling_policy, config)
        self.waiting = waiting_queue
        self.running: list[Request] = []
        self._pending_forks: dict[str, list[Request]] = {}  # leader id -> samples waiting on it
        self._finished_ids: list[str] = []
        # (victim, the waiting request it makes room for): preempted when the next step starts
        self._to_preempt: list[tuple[Request, Request]] = []
        self.tenant_weights: dict[str, float] = {}
        self.constraints = constraints
        self.residency = residency
        if residency is not None:
            residency.on_load = self._charge_load
        self._lora_tenant: dict[str, Tenant] = {}  # adapter key -> tenant of its last request
        self._failed_keys: dict[str, str] = {}  # adapters found failed in this admission pass
        self._errors: list[EngineCoreOutput] = []  # requests ended in schedule(), for update()
        self.stats = SchedulerStats()

    # ---- requests in and out ---------------------------------------------------------------

    def check_request(self, req: Request) -> None:
        """``ValueError`` for a request ``add_request`` would refuse."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if self.kv.blocks_needed(min(req.num_tokens + 1, self.max_model_len)) > (
            self.kv.num_usable_blocks
        ):
            raise ValueError(
                f"the prompt ({req.num_tokens} tokens) does not fit in the KV cache "
                f"({self.kv.num_usable_blocks} blocks of {self.kv.block_size}); "
                "give the engine more KV memory or send a shorter prompt"
            )

    def add_request(self, req: Request) -> None:
        self.check_request(req)
        self.requests[req.request_id] = req
        if req.lora_key is not None:
            self._lora_tenant[req.lora_key] = req.tenant
        if req.queued_time is None:  # set already when it waited for its grammar
            req.queued_time = time.monotonic()
        leader = self.requests.get(req.parent_id) if req.parent_id else None
        if leader is not None and leader.num_output_tokens == 0 and not leader.status.finished:
            self._pending_forks.setdefault(leader.request_id, []).append(req)
        else:
            self.waiting.add(req)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Remove requests wherever they are; their blocks return at once."""
        aborted: list[Request] = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif not self.waiting.remove(req):
                for samples in self._pending_forks.values():
                    if req in samples:
                        samples.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._errors)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(s) for s in self._pending_forks.values())

    def waiting_requests(self) -> list[Request]:
        """Every waiting request: queued, and samples waiting on their leader's prompt."""
        return [*self.waiting, *(r for s in self._pending_forks.values() for r in s)]

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """Tenant id -> share weight (finite, above 0; a tenant not named weighs 1.0), for the
        service charged from the next step on. Replaces the previous weights."""
        checked = check_tenant_weights(weights)
        self.tenant_weights = checked
        self.waiting.set_tenant_weights(dict(checked))
        if self.residency is not None:
            self.residency.set_tenant_weights(checked)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Forget the request's tokens from position ``num_tokens`` on, and their KV: rejected
        draft tokens (speculative decoding), a grammar's rollback. The prompt always stays.

        The KV kept is at most ``num_tokens - 1`` tokens: the last token left is computed again
        next step, since its logits sample the next token.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id!r} is not in the engine (finished or unknown)")
        dropped = req.num_tokens - num_tokens
        req.truncate(num_tokens)  # checks num_tokens first
        if self.constraints is not None and req.params.structured_outputs is not None:
            self.constraints.rollback(req, dropped)
        req.num_computed_tokens = min(req.num_computed_tokens, num_tokens - 1)
        self.kv.trim(req, req.num_computed_tokens)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        scheduled: list[ScheduledRequest] = []
        if self._to_preempt:
            self._preempt_marked()
        budget, preempted = self._schedule_running(scheduled, self.config.max_num_batched_tokens)
        if not preempted and len(self.waiting):  # a step that had to preempt has no room
            budget = self._schedule_waiting(scheduled, budget)
        forks = self._schedule_forks(scheduled)
        self.stats.num_steps += 1
        finished, self._finished_ids = self._finished_ids, []
        lora_slots = self.slots.in_use()
        plan = None if self.residency is None else self.residency.plan_step(lora_slots)
        return SchedulerOutput(
            requests=scheduled,
            forks=forks,
            blocks_to_copy=self.kv.take_copies(),
            finished_request_ids=finished,
            lora_slots=lora_slots,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            lora_plan=plan,
        )

    def _schedule_running(self, scheduled: list[ScheduledRequest], budget: int) -> tuple[int, bool]:
        """Running requests, oldest first, within ``budget`` tokens; returns the budget left and
        whether a request was preempted. While a request's blocks do not fit, the policy's
        victim among it and the requests after it is preempted; the pass ends when the victim
        is the request itself."""
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._take_drafts(req, num_new, budget)
            while not self.kv.allocate_slots(req, num_new, num_lookahead_tokens=len(drafts)):
                if drafts:  # no room for the drafts: decode without them before preempting
                    drafts = []
                    continue
                victim = self.running.pop(self._victim(i))
                self._preempt(victim)
                preempted = True
                if victim is req:
                    return budget, preempted
            scheduled.append(self._scheduled(req, num_new, drafts))
            budget -= num_new + len(drafts)
            i += 1
        return budget, preempted

    def _take_drafts(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The request's draft tokens for this step (emptied on the request): only for a decode
        (one token to compute), within the token budget and below ``max_model_len``."""
        drafts, req.draft_token_ids = req.draft_token_ids, []
        if not drafts or num_new != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return []
        return drafts[: min(budget - 1, self.max_model_len - req.num_tokens)]

    def _victim(self, first: int) -> int:
        index = self.waiting.preemption_victim(self.running, first)
        if not first <= index < len(self.running):
            raise RuntimeError(
                f"the scheduling policy chose running request {index} to preempt; it must be "
                f"one of {first}..{len(self.running) - 1} (not yet scheduled this step)"
            )
        return index

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Admit waiting requests in the policy's order while the token budget, ``max_num_seqs``
        and the KV pool allow; returns the budget left. A request that does not fit keeps its
        place and ends the pass (and may have victims marked for it: ``_mark_victims``)."""
        waiting = self.waiting
        waiting.begin_admission(self._lora_ready, self.slots.holds, self._tenant_slots())
        try:
            while budget > 0:
                if len(self.running) >= self.config.max_num_seqs:
                    if waiting.priority_preemption and (req := waiting.peek()) is not None:
                        self._mark_victims(req, [])
                    break
                req = waiting.peek()
                if req is None:
                    break
                hits = self.kv.get_computed_blocks(req)
                num_hit = len(hits) * self.kv.block_size
                num_new = min(req.num_tokens - num_hit, budget)
                if not self.kv.allocate_slots(req, num_new, hits):
                    if waiting.priority_preemption:
                        self._mark_victims(req, hits, self.kv.num_blocks_short(req, num_new, hits))
                    break
                waiting.pop()
                self._admit(req, num_hit)
                scheduled.append(self._scheduled(req, num_new))
                budget -= num_new
            if waiting.priority_preemption and not self._to_preempt:
                found = waiting.slot_victims(self.running, self.slots.max_loras)
                if found is not None:
                    claimant, victims = found
                    self._to_preempt = [(v, claimant) for v in victims]
        finally:
            waiting.end_admission()
        if self._failed_keys:
            self._fail_adapter_requests()
        return budget

    def _tenant_slots(self) -> TenantSlots:
        held: dict[Tenant, set[str]] = {}
        for r in self.running:
            if r.lora_key is not None:
                held.setdefault(r.tenant, set()).add(r.lora_key)
        in_use = len(self.slots.in_use())
        return TenantSlots(
            self.slots.max_loras,
            self.slots.max_loras - in_use,
            {t: len(keys) for t, keys in held.items()},
        )

    def _lora_ready(self, key: str) -> bool:
        """A request on adapter ``key`` may be admitted: its weights ready in the pool and a
        slot for it. Asking notes the demand (residency loads it after admission)."""
        if self.residency is not None:
            state = self.residency.status(key, self._lora_tenant.get(key))
            if isinstance(state, Failed):
                self._failed_keys[key] = state.reason
                return False
            if not isinstance(state, Ready):
                return False
        return self.slots.can_acquire(key)

    def _fail_adapter_requests(self) -> None:
        """End every waiting request on an adapter that failed, with its reason."""
        failed, self._failed_keys = self._failed_keys, {}
        for req in [r for r in self.waiting if r.lora_key in failed]:
            assert req.lora_key is not None
            self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ERROR)
            self._errors.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[],
                    finish_reason=RequestStatus.FINISHED_ERROR.value,
                    queue_time=req.queue_time,
                    error=failed[req.lora_key],
                    error_code=ADAPTER_FAILED,
                )
            )

    def _charge_load(self, tenant: Tenant, nbytes: int) -> None:
        self.waiting.charge_work(tenant, nbytes / LOAD_BYTES_PER_TOKEN)

    def _mark_victims(self, req: Request, hits: list[int], blocks: int = 0) -> None:
        """``req`` found no seat (``blocks`` 0) or lacks ``blocks`` KV blocks: mark the policy's
        victims for it, the fewest (in the policy's order) that make the room, or none when
        all of them together would not (prefix ``hits`` it would take are not counted)."""
        chosen: list[str] = []
        marked: list[tuple[Request, Request]] = []
        for victim in self.waiting.admission_victims(self.running, req):
            same = victim.priority == req.priority
            if victim.priority < req.priority or (same and victim.tenant == req.tenant):
                raise RuntimeError(
                    f"the scheduling policy named running request {victim.request_id!r} "
                    f"(priority {victim.priority}) to make room for {req.request_id!r} "
                    f"(priority {req.priority}); a victim's priority must not be better, and "
                    "a request of the same priority must belong to another tenant"
                )
            chosen.append(victim.request_id)
            marked.append((victim, req))
            if self.kv.num_freed_by(chosen, hits) >= blocks:
                self._to_preempt = marked
                return

    def _preempt_marked(self) -> None:
        """Preempt the victims marked last step, those still running for a request still
        waiting."""
        marked, self._to_preempt = self._to_preempt, []
        for victim, req in marked:
            if (
                victim.status == RequestStatus.RUNNING
                and req.status == RequestStatus.WAITING
                and req.request_id in self.requests
            ):
                self.running.remove(victim)
                self._preempt(victim)

    def _admit(self, req: Request, num_hit: int) -> None:
        """``req`` got its blocks (``num_hit`` tokens of them from the prefix cache): running."""
        self.kv.record_prefix_query(req.num_tokens, num_hit)
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.RUNNING
        if req.scheduled_time is None:
            req.scheduled_time = time.monotonic()
        self.slots.acquire(req.lora_key)
        self.running.append(req)

    def _schedule_forks(self, scheduled: list[ScheduledRequest]) -> list[ForkedSample]:
        """Fork the samples of n > 1 requests whose leader finishes its prompt this step."""
        forks: list[ForkedSample] = []
        if self._pending_forks:
            for s in scheduled:
                if s.sample and s.request_id in self._pending_forks:
                    forks.extend(self._fork(self.requests[s.request_id]))
        return forks

    def _scheduled(
        self, req: Request, num_new: int, drafts: list[int] | None = None
    ) -> ScheduledRequest:
        start = req.num_computed_tokens
        token_ids = req.all_token_ids[start : start + num_new]
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=token_ids + drafts if drafts else token_ids,
            start_pos=start,
            block_table=self.kv.block_table(req.request_id),
            sample=start + num_new == req.num_tokens,
            params=req.params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            lora_slot=self.slots.slot_of(req.lora_key),
            draft_token_ids=drafts or [],
        )

    def _fork(self, leader: Request) -> list[ForkedSample]:
        samples = self._pending_forks.pop(leader.request_id)
        forks: list[ForkedSample] = []
        for req in samples:
            if len(self.running) >= self.config.max_num_seqs:
                # No room to run it now: it prefills on its own later (prefix cache helps).
                self.waiting.add(req)
                continue
            self.kv.fork(leader.request_id, req.request_id)
            req.status = RequestStatus.RUNNING
            req.scheduled_time = time.monotonic()
            self.slots.acquire(req.lora_key)
            self.running.append(req)
            forks.append(
                ForkedSample(
                    request_id=req.request_id,
                    parent_id=leader.request_id,
                    params=req.params,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=req.output_token_ids,
                    lora_slot=self.slots.slot_of(req.lora_key),
                )
            )
        return forks

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        self.slots.release(req.lora_key)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(req)

    # ---- results ---------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._errors = self._errors, []
        if self.residency is not None:
            for load in result.lora_loads:
                self.residency.loaded(load)
        served: list[Service] = []
        done: set[str] = set()
        for s in out.requests:
            req = self.requests[s.request_id]
            end = min(s.start_pos + len(s.token_ids), req.num_prompt_tokens)
            num_prompt = max(end - s.start_pos, 0)
            req.num_computed_tokens += len(s.token_ids)
            num_generated = 0
            if s.sample:
                output = self._append(req, result, done)
                outputs.append(output)
                num_generated = len(output.new_token_ids)
                if s.draft_token_ids and req.request_id not in done:
                    # KV was computed for every draft; keep that of the accepted ones (the
                    # tokens appended but the last), trim the rest
                    self.rollback(req.request_id, req.num_tokens)
            served.append(Service(req, num_prompt, num_generated))
        for f in out.forks:
            req = self.requests[f.request_id]
            req.num_computed_tokens = req.num_prompt_tokens
            output = self._append(req, result, done)
            outputs.append(output)
            served.append(Service(req, 0, len(output.new_token_ids)))
        if done:
            self.running = [r for r in self.running if r.request_id not in done]
        self._count(served)
        self.waiting.charge(served, self.running)
        return outputs

    def _count(self, served: list[Service]) -> None:
        stats = self.stats
        for s in served:
            usage = stats.tenants.get(s.request.tenant)
            if usage is None:
                usage = stats.tenants[s.request.tenant] = TenantUsage()
            usage.num_prompt_tokens_computed += s.prompt_tokens
            usage.num_generated_tokens += s.output_tokens
            stats.num_prompt_tokens_computed += s.prompt_tokens
            stats.num_generated_tokens += s.output_tokens

    def _append(self, req: Request, result: RunnerOutput, done: set[str]) -> EngineCoreOutput:
        """Append the tokens sampled for ``req`` this step (one, or several: speculative
        decoding), checking the stop conditions after each, as vLLM does: the token that ends
        the request is kept and the ones after it are dropped."""
        tokens = result.sampled[req.request_id]
        queue_time = req.queue_time if req.num_output_tokens == 0 else None
        params = req.params
        constraints = self.constraints if params.structured_outputs is not None else None
        status: RequestStatus | None = None
        stop_reason: int | None = None
        error: str | None = None
        error_code: str | None = None
        kept = 0
        for token in tokens:
            req.append_output_token(token)
            kept += 1
            if not params.ignore_eos and token in req.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token in params.stop_ids:
                status = RequestStatus.FINISHED_STOPPED
                stop_reason = token
            elif constraints is not None:  # the constraint may end it here
                status, error, error_code = _advance(constraints, req, token)
            if status is None and (
                (params.max_tokens is not None and req.num_output_tokens >= params.max_tokens)
                or req.num_tokens >= self.max_model_len
            ):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                break
        out = EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=tokens if kept == len(tokens) else tokens[:kept],
            num_cached_tokens=req.num_cached_tokens,
            stop_reason=stop_reason,
            queue_time=queue_time,
            error=error,
            error_code=error_code,
        )
        logprobs = result.logprobs.get(req.request_id)
        if logprobs is not None:
            out.new_logprobs = logprobs if kept == len(logprobs) else logprobs[:kept]
        if status is not None:
            self._finish(req, status)
            out.finish_reason = status.value
            done.add(req.request_id)
        return out

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.slots.release(req.lora_key)
        req.status = status
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        if self.constraints is not None and req.params.structured_outputs is not None:
            self.constraints.forget(req.request_id)
        self._finished_ids.append(req.request_id)
        # Samples still waiting on a leader that ends before finishing its prompt run alone.
        for sample in self._pending_forks.pop(req.request_id, []):
            self.waiting.add(sample)


def _advance(
    constraints: TokenConstraints, req: Request, token: int
) -> tuple[RequestStatus | None, str | None, str | None]:
    """Report ``token`` to the request's constraint: (None, None, None) to go on, (stopped,
    None, None) when the constraint is complete, (error, why, code) when it failed (``code``:
    the exception's ``code`` attribute, e.g. "constraint_too_costly", else None)."""
    try:
        done = constraints.advance(req, token)
    except Exception as exc:
        code = getattr(exc, "code", None)
        why = str(exc) or type(exc).__name__
        return RequestStatus.FINISHED_ERROR, why, code if isinstance(code, str) else None
    return (RequestStatus.FINISHED_STOPPED, None, None) if done else (None, None, None)
