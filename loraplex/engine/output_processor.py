"""Turns the engine core's token outputs into RequestOutputs: detokenization, stop strings,
logprobs and the fan-in of the n samples of a request. Runs beside the tokenizer (the frontend),
never inside the model loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from loraplex.detokenizer import IncrementalDetokenizer
from loraplex.engine.records import EngineCoreOutput, TokenLogprobs
from loraplex.outputs import CompletionOutput, Logprob, RequestOutput
from loraplex.sampling_params import SamplingParams


@dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


def sample_ids(request_id: str, n: int) -> list[str]:
    """Engine-core ids of the n samples of a request; the first is the request's own id."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


class OutputProcessor:
    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._sample_of: dict[str, tuple[_RequestState, _Sample]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenize: bool = True,
    ) -> list[str]:
        samples = []
        for i in range(params.n):
            detok = None
            if detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            samples.append(_Sample(i, detok, logprobs=[] if params.logprobs is not None else None))
        state = _RequestState(request_id, prompt, prompt_token_ids, params, samples)
        self._states[request_id] = state
        ids = sample_ids(request_id, params.n)
        for sid, sample in zip(ids, samples, strict=False):
            self._sample_of[sid] = (state, sample)
        return ids

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    @property
    def num_unfinished(self) -> int:
        return len(self._states)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished sample aborted; the caller aborts them in the core."""
        state = self._states.get(request_id)
        if state is None:
            return None
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        return self._finish(state)

    def unfinished_sample_ids(self, request_id: str) -> list[str]:
        state = self._states.get(request_id)
        if state is None:
            return []
        ids = sample_ids(request_id, state.params.n)
        return [sid for sid, s in zip(ids, state.samples, strict=False) if s.finish_reason is None]

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns the changed requests' outputs, and the sample ids
        that hit a stop string (the caller aborts them in the core)."""
        changed: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        for out in outputs:
            entry = self._sample_of.get(out.request_id)
            if entry is None:
                continue
            state, sample = entry
            if sample.finish_reason is not None:
                continue
            if state.first_token_time is None:
                state.first_token_time = now
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            sample.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None and sample.logprobs is not None:
                self._add_logprobs(sample, out.new_logprobs)
            if sample.detok is not None:
                delta = sample.detok.push(out.new_token_ids)
                if delta.stopped:
                    sample.finish_reason = "stop"
                    sample.stop_reason = delta.stop_str
                    if out.finish_reason is None:
                        to_abort.append(out.request_id)
            if sample.finish_reason is None and out.finish_reason is not None:
                sample.finish_reason = out.finish_reason
                sample.stop_reason = out.stop_reason
                sample.error = out.error
            if sample.finish_reason is not None:
                self._sample_of.pop(out.request_id, None)
            changed[state.request_id] = state
        results = []
        for state in changed.values():
            if state.finished:
                results.append(self._finish(state))
            else:
                results.append(self._build(state))
        return results, to_abort

    def _add_logprobs(self, sample: _Sample, items: list[TokenLogprobs]) -> None:
        assert sample.logprobs is not None
        for lp in items:
            entry = {
                tok: Logprob(val, rank + 1, self._decode(tok))
                for rank, (tok, val) in enumerate(lp.top)
            }
            entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self._decode(lp.token_id))
            sample.logprobs.append(entry)
            sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + lp.logprob

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode([token_id]))

    def _finish(self, state: _RequestState) -> RequestOutput:
        for sample in state.samples:
            if sample.detok is not None:
                sample.detok.flush()
        self._states.pop(state.request_id, None)
        for sid in sample_ids(state.request_id, state.params.n):
            self._sample_of.pop(sid, None)
        out = self._build(state)
        out.finished = True
        return out

    def _build(self, state: _RequestState) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.detok.text if s.detok is not None else "",
                token_ids=list(s.token_ids),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                cumulative_logprob=s.cumulative_logprob,
                error=s.error,
            )
            for s in state.samples
        ]
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["time_to_first_token"] = state.first_token_time - state.arrival_time
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=metrics,
        )
