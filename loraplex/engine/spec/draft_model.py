"""Drafting with a smaller model: the same vocabulary as the served model, run greedily on the
base weights only (no adapters), on its own small paged KV cache.

Each request has a draft sequence: a ``Request`` of this module's own KV manager, whose tokens
are those the draft model has KV for. A step's proposal:

1. keep the draft KV of the longest common prefix of the draft sequence and the request's
   tokens (the rejected drafts of the last step and anything else that changed are trimmed);
2. compute the rest of the request's tokens (the last step's accepted drafts and the new token;
   a whole prompt the first time, in chunks of ``max_num_batched_tokens`` per step, drafting
   only once caught up): this forward's last row gives the first draft;
3. one forward per further draft, each feeding the previous draft.

Every forward batches all drafting requests (a ``SchedulerOutput`` to a ``ModelRunner`` of the
draft model, as the engine's own steps). A request whose draft KV does not fit drafts nothing
that step (its draft sequence is dropped); nothing is preempted for a draft.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.config import CacheConfig, ModelConfig, SchedulerConfig
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.records import ScheduledRequest, SchedulerOutput
from loraplex.engine.request import Request
from loraplex.engine.runner import ModelRunner
from loraplex.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
# The draft KV cache holds every running sequence at full length, up to this many bytes (the
# served model's own CPU default).
DRAFT_KV_BYTES = 1 << 30


@dataclass
class _DraftSeq:
    seq: Request  # all_token_ids: the tokens with draft KV; num_computed_tokens == their count
    base: int = 0  # leading tokens of ``seq`` taken from the request (not drafts) last time


class DraftModelProposer:
    name = "draft_model"

    def __init__(
        self,
        model_dir: str,
        model_config: ModelConfig,
        block_size: int,
        scheduler_config: SchedulerConfig,
        max_drafts: int,
        vocab_size: int,
        max_model_len: int,
    ) -> None:
        """``max_model_len``: the served model's longest sequence (at most)."""
        draft_config = ModelConfig(
            model=model_dir,
            dtype=model_config.dtype,
            device=model_config.device,
            seed=model_config.seed,
            attention_backend=model_config.attention_backend,
        )
        self.runner = ModelRunner(
            draft_config, CacheConfig(block_size=block_size), scheduler_config, model_dir
        )
        spec = self.runner.spec
        if spec.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model {model_dir!r} has a vocabulary of {spec.vocab_size} tokens, "
                f"the served model {vocab_size}; a draft model must share the served model's "
                "tokenizer (e.g. a smaller model of the same family)"
            )
        self.max_len = min(self.runner.max_model_len, max_model_len)
        per_seq = -(-(self.max_len + max_drafts) // block_size)
        per_block = spec.kv_bytes_per_block(block_size)
        wanted = scheduler_config.max_num_seqs * per_seq + 1
        num_blocks = max(min(wanted, DRAFT_KV_BYTES // per_block), 2)
        # Sized here, before allocation: the runner's own default would size it as a target's.
        self.runner.cache_config = CacheConfig(block_size=block_size, num_blocks=num_blocks)
        self.runner.init_kv_cache()
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.chunk = scheduler_config.max_num_batched_tokens
        self._seqs: dict[str, _DraftSeq] = {}

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._seqs.pop(rid, None) is not None:
                self.kv.free(rid)

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {}
        want: dict[str, int] = {}
        first: list[ScheduledRequest] = []
        budget = self.chunk
        for req, k in zip(requests, num_drafts, strict=True):
            tokens = req.all_token_ids
            if len(tokens) + k > self.max_len or budget <= 0:
                continue
            draft = self._sync(req.request_id, tokens)
            seq = draft.seq
            start = seq.num_computed_tokens
            todo = min(len(tokens) - start, budget)
            caught_up = start + todo == len(tokens)
            lookahead = k - 1 if caught_up else 0
            if not self.kv.allocate_slots(seq, todo, num_lookahead_tokens=lookahead):
                self.forget([req.request_id])
                continue
            budget -= todo
            new = tokens[start : start + todo]
            first.append(self._scheduled(seq, new, caught_up))
            seq.all_token_ids.extend(new)
            seq.num_computed_tokens += todo
            draft.base = seq.num_computed_tokens  # the request's own tokens, drafts not yet
            if caught_up:
                drafts[req.request_id] = []
                want[req.request_id] = k
        batch = first
        while batch:
            sampled = self.runner.execute(self._step(batch)).sampled
            batch = []
            for rid, out in sampled.items():
                got = drafts[rid]
                got.append(out[0])
                if len(got) < want[rid]:  # feed this draft to get the next one
                    seq = self._seqs[rid].seq
                    batch.append(self._scheduled(seq, [out[0]], True))
                    seq.all_token_ids.append(out[0])
                    seq.num_computed_tokens += 1
        return [drafts.get(r.request_id, []) for r in requests]

    def _sync(self, rid: str, tokens: list[int]) -> _DraftSeq:
        """The request's draft sequence, trimmed to its longest common prefix with ``tokens``
        (never all of them: the last token is computed again, its logits give a draft)."""
        draft = self._seqs.get(rid)
        if draft is None:
            draft = self._seqs[rid] = _DraftSeq(Request(rid, [], _GREEDY))
        have = draft.seq.all_token_ids
        n = draft.base
        if n > len(tokens) or tokens[:n] != have[:n]:  # the request was rolled back
            n = 0
        limit = min(len(have), len(tokens) - 1)
        while n < limit and have[n] == tokens[n]:
            n += 1
        n = min(n, limit)
        if n < len(have):
            del have[n:]
            draft.seq.num_computed_tokens = n
            self.kv.trim(draft.seq, n)
        return draft

    def _scheduled(self, seq: Request, new: list[int], sample: bool) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=seq.request_id,
            token_ids=new,
            start_pos=seq.num_computed_tokens,
            block_table=self.kv.block_table(seq.request_id),
            sample=sample,
            params=_GREEDY,
            prompt_token_ids=[],
            output_token_ids=[],
        )

    def _step(self, batch: list[ScheduledRequest]) -> SchedulerOutput:
        # The draft sampler keeps no state for its rows (greedy, no penalties, no seed): no
        # finished ids to pass on.
        return SchedulerOutput(
            requests=batch,
            blocks_to_copy=self.kv.take_copies(),
            num_batched_tokens=sum(len(s.token_ids) for s in batch),
        )
