"""The engine's view of one request (one sample of it when n > 1). Pure Python, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from loraplex.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the request's constraint failed (EngineCoreOutput.error says why)

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


@dataclass
class Request:
    """State the scheduler keeps for one sequence.

    Invariant: ``num_computed_tokens <= num_tokens``; tokens ``[0, num_computed_tokens)`` have KV
    in this request's blocks. A decode step schedules exactly one token (the last sampled one).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()  # any of these ends the request (unless ignore_eos)
    # Identity of everything besides the tokens that changes the KV: the adapter's content hash
    # and the tenant's cache salt. Part of every prefix-cache block hash.
    cache_extra_keys: tuple[str, ...] = ()
    lora_key: str | None = None  # the adapter's content hash; None = the base model
    # Scheduling identity: which tenant sent it (opaque; None = no tenant, e.g. offline) and its
    # priority (lower runs earlier, as in vLLM). Policies read them; FCFS ignores both.
    tenant: str | None = None
    priority: int = 0
    parent_id: str | None = None  # set on the samples of an n > 1 request
    arrival_time: float = field(default_factory=time.monotonic)  # built (by the client)
    queued_time: float | None = None  # the scheduler received it (time.monotonic())
    scheduled_time: float | None = None  # first admitted to a step (preemptions do not reset it)

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    lora_wait_steps: int = 0  # steps skipped because no LoRA slot was free
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)  # one per full block of all_token_ids
    # speculative decoding: tokens proposed after the last one, verified in the next step that
    # schedules this request as a decode (engine/spec/); taken (emptied) when scheduled
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def queue_time(self) -> float | None:
        """Seconds from reaching the scheduler to first being scheduled; None until then."""
        if self.queued_time is None or self.scheduled_time is None:
            return None
        return max(self.scheduled_time - self.queued_time, 0.0)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens: drop generated tokens after them (rejected
        drafts, a grammar rollback). In place: scheduled records reference these lists."""
        if not self.num_prompt_tokens <= num_tokens <= self.num_tokens:
            raise ValueError(
                f"request {self.request_id!r}: cannot truncate to {num_tokens} tokens; keep "
                f"{self.num_prompt_tokens} (the prompt) to {self.num_tokens} (all of them)"
            )
        del self.output_token_ids[num_tokens - self.num_prompt_tokens :]
        del self.all_token_ids[num_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens)
