"""The plain records that cross between the scheduler and the runner (and out of the engine).

The scheduler builds a ``SchedulerOutput``; the runner turns it into tensors, runs the model and
returns a ``RunnerOutput``; the scheduler consumes that in ``update``. Neither calls the other.
Lists here are references to the scheduler's own lists (no copies): the runner only reads them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.lora.plan import AdapterPlan, LoadResult
from loraplex.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute KV for ``token_ids`` starting at ``start_pos``."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step (a prefill chunk, or the last sampled one)
    start_pos: int  # position of token_ids[0] == num_computed_tokens before this step
    block_table: list[int]  # all blocks of the request, covering start_pos + len(token_ids)
    sample: bool  # True when this step reaches the end of the known tokens: sample one more
    params: SamplingParams
    prompt_token_ids: list[int]  # for the repetition penalty
    output_token_ids: list[int]  # tokens generated so far (penalties)
    lora_slot: int = -1  # device slot of the request's adapter, -1 = base model
    # speculative decoding: draft tokens computed after token_ids[-1] (``token_ids`` ends with
    # them); the runner samples one row per draft plus one (verification)
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class ForkedSample:
    """A sample of an n > 1 request that takes its first token from its parent's last row."""

    request_id: str
    parent_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    lora_slot: int = -1  # the parent's adapter slot (samples share the adapter)


@dataclass
class SchedulerOutput:
    requests: list[ScheduledRequest]
    forks: list[ForkedSample] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(
        default_factory=list
    )  # (src, dst), before forward
    finished_request_ids: list[str] = field(default_factory=list)  # since the last step: drop state
    lora_slots: dict[int, str] = field(
        default_factory=dict
    )  # device slot -> adapter key, this step
    # adapter residency's decisions for the runner to carry out (copies, slot rows); None
    # without LoRA
    lora_plan: AdapterPlan | None = None
    num_batched_tokens: int = 0
    # request id -> the tokens its sample may take this step (structured output), a packed
    # bitmask from ``token_bitmask``; requests not listed sample from the whole vocabulary
    token_masks: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.requests


def token_bitmask(allowed: Iterable[int], vocab_size: int) -> np.ndarray:
    """The packed mask of the tokens a row may sample: ``ceil(vocab_size / 32)`` int32 words,
    token ``t`` allowed when bit ``t % 32`` of word ``t // 32`` is set (xgrammar's layout, so a
    grammar matcher's bitmask can be passed as it is)."""
    import numpy as np  # here, not at the top: the scheduler side of the records stays lean

    bits = np.zeros(-(-vocab_size // 32) * 32, dtype=np.uint8)
    ids = np.fromiter(allowed, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must be in 0..{vocab_size - 1}")
    bits[ids] = 1
    words = np.packbits(bits, bitorder="little").view("<i4")  # little-endian words
    return words.astype(np.int32, copy=False)  # [ceil(V / 32)]


@dataclass
class TokenLogprobs:
    """Logprobs of one generated token: the sampled token's, and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first


@dataclass
class RunnerOutput:
    """What one step sampled. Every sampling request and fork gets a list of tokens, in order:
    one today; several where a step verifies draft tokens (speculative decoding). The scheduler
    appends them one by one and drops those after a token that ends the request."""

    sampled: dict[str, list[int]]  # request_id -> the step's new tokens (at least one)
    # request_id -> one entry per token of ``sampled``; only where params.logprobs
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # adapter copies that finished since the last step (ok or failed), for residency
    lora_loads: list[LoadResult] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """What one step produced for one request: new tokens, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds waiting to be scheduled; on the first output only
    # finish_reason "error": why the engine could not serve the request (its structured-output
    # constraint failed to compile, or its matcher failed, or its adapter failed to load), a
    # message for the client
    error: str | None = None
    # what kind of error: "adapter_failed" (the request's adapter could not be loaded), or
    # None (a constraint's)
    error_code: str | None = None
