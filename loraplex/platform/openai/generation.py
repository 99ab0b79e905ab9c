"""From prompts to choice events: engine streams, incremental detokenization, stop strings.

One ``Generation`` runs one API request: one engine request per prompt (a completions batch may
hold several), each with ``n`` samples. Choice ``i * n + j`` is sample ``j`` of prompt ``i``.
Events carry only safe text (whole characters, never part of a possible stop string). A choice
ends when the engine finishes its sample or a stop string matches; when every choice of a prompt
has ended, that prompt's engine stream is closed, which aborts whatever the engine still runs.
Closing ``events()`` early (client gone, error) closes every stream: nothing keeps running.

Timing for the metrics (``time.perf_counter()`` clock): when the first token of any choice
arrived, the mean gap between consecutive tokens of a choice, and the engine's queue time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from loraplex.detokenizer import IncrementalDetokenizer
from loraplex.engine.client import EngineClient, RequestDelta
from loraplex.engine.records import TokenLogprobs
from loraplex.sampling_params import SamplingParams

ADAPTER_FAILED = "adapter_failed"  # the engine's error_code: the request's adapter failed to load


class EngineRequestError(Exception):
    """The engine ended a sample with ``finish_reason: "error"``; the message is the engine's.
    ``code``: the engine's ``error_code``: ``ADAPTER_FAILED`` when the request's adapter could
    not be loaded (its files missing or damaged, bad weights, no room in the pool), None when
    its structured-output constraint failed to compile or to match. The request is lost, the
    engine is fine."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ChoiceEvent:
    index: int
    text: str  # new text, safe to show
    token_ids: list[int]
    logprobs: list[TokenLogprobs]  # one per token of token_ids when logprobs were asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" when this choice ended


@dataclass
class GenerationUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class _Choice:
    index: int
    detok: IncrementalDetokenizer
    done: bool = False
    num_tokens: int = 0
    first_token_time: float = 0.0  # perf_counter() times; meaningful once num_tokens > 0
    last_token_time: float = 0.0


@dataclass
class _PromptRun:
    stream: AsyncIterator[RequestDelta]
    choices: list[_Choice]
    cached_tokens: int = 0


class Generation:
    """Opens the engine streams at construction, so bad input (``ValueError``) and a dead engine
    (``EngineDeadError``) raise before any response is started."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        lora_key: str | None = None,
        cache_extra_keys: tuple[str, ...] = (),
        tenant: str | None = None,
        priority: int = 0,
    ) -> None:
        """``tenant``: the caller's tenant id (the engine's scheduling policy sees it);
        ``priority``: lower runs earlier."""
        self.usage = GenerationUsage(prompt_tokens=sum(len(p) for p in prompts))
        self.first_token_time: float | None = None  # perf_counter() at the first token
        self.queue_time: float | None = None  # the longest engine queue time of its samples
        self._runs: list[_PromptRun] = []
        n = params.n
        self.finish_reasons: list[str | None] = [None] * (n * len(prompts))
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            # An engine stream is submitted on its first iteration: one never iterated (a later
            # prompt raised here) leaks nothing.
            stream = client.generate(
                rid,
                prompt,
                params,
                lora_key=lora_key,
                cache_extra_keys=cache_extra_keys,
                tenant=tenant,
                priority=priority,
            )
            choices = [
                _Choice(i * n + j, IncrementalDetokenizer(tokenizer, prompt, params))
                for j in range(n)
            ]
            self._runs.append(_PromptRun(stream, choices))

    @property
    def num_choices(self) -> int:
        return sum(len(run.choices) for run in self._runs)

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between consecutive tokens of a choice, over the choices with two
        tokens or more; None when there are none."""
        gaps = [
            (c.last_token_time - c.first_token_time) / (c.num_tokens - 1)
            for run in self._runs
            for c in run.choices
            if c.num_tokens > 1
        ]
        return sum(gaps) / len(gaps) if gaps else None

    async def events(self) -> AsyncGenerator[ChoiceEvent, None]:
        if len(self._runs) == 1:
            gen = self._run_events(self._runs[0])
            try:
                async for event in gen:
                    yield event
            finally:
                with anyio.CancelScope(shield=True):
                    await gen.aclose()
            return
        async for event in _merge([self._run_events(run) for run in self._runs]):
            yield event

    async def _run_events(self, run: _PromptRun) -> AsyncGenerator[ChoiceEvent, None]:
        try:
            async for delta in run.stream:
                run.cached_tokens = max(run.cached_tokens, delta.num_cached_tokens)
                if delta.queue_time is not None:
                    self.queue_time = max(self.queue_time or 0.0, delta.queue_time)
                choice = run.choices[delta.index]
                if choice.done:
                    continue  # ended by a stop string; the engine does not know
                event = self._advance(choice, delta)
                if event.text or event.token_ids or event.finish_reason:
                    yield event
                if all(c.done for c in run.choices):
                    break
        finally:
            self.usage.cached_tokens += run.cached_tokens
            with anyio.CancelScope(shield=True):
                await _close(run.stream)  # aborts the samples still running, if any

    def _advance(self, choice: _Choice, delta: RequestDelta) -> ChoiceEvent:
        if delta.finish_reason == "error":
            self.finish_reasons[choice.index] = "error"
            raise EngineRequestError(
                delta.error or "the engine could not serve this request", delta.error_code
            )
        ids = delta.new_token_ids
        self.usage.completion_tokens += len(ids)
        if ids:
            now = time.perf_counter()
            if not choice.num_tokens:
                choice.first_token_time = now
            if self.first_token_time is None:
                self.first_token_time = now
            choice.last_token_time = now
            choice.num_tokens += len(ids)
        out = choice.detok.push(ids)
        text, finish = out.new_text, None
        if out.stopped:
            finish = "stop"
        elif delta.finish_reason is not None:
            text += choice.detok.flush()
            finish = delta.finish_reason
        choice.done = finish is not None
        if finish is not None:
            self.finish_reasons[choice.index] = finish
        return ChoiceEvent(choice.index, text, list(ids), list(delta.new_logprobs or ()), finish)


async def _close(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


_DONE = object()


async def _merge(
    gens: list[AsyncGenerator[ChoiceEvent, None]],
) -> AsyncGenerator[ChoiceEvent, None]:
    """Interleave several event streams as their items arrive; closing this closes them all."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(gen: AsyncGenerator[ChoiceEvent, None]) -> None:
        try:
            async for item in gen:
                await queue.put(item)
            await queue.put(_DONE)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await queue.put(exc)
        finally:
            await _close(gen)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
