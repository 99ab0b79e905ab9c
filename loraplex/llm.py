"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from typing_extensions import Unpack

from loraplex.engine.info import EngineStats
from loraplex.engine.llm_engine import LLMEngine, Prompt
from loraplex.engine_args import EngineKwargs, engine_config
from loraplex.lora.request import LoRARequest
from loraplex.outputs import RequestOutput
from loraplex.sampling_params import SamplingParams


class LLM:
    """One base model, batched generation over many prompts.

    ``model`` is a local Hugging Face directory (or a hub id where there is network); ``None``
    serves the embedded SmolLM2-135M-Instruct.
    """

    def __init__(self, model: str | None = None, **engine: Unpack[EngineKwargs]) -> None:
        """``engine``: the engine's knobs (``loraplex.engine_args``: ``dtype``, ``block_size``,
        ``max_num_seqs``, ``max_loras``, ...); each one not given keeps ``EngineConfig``'s
        default."""
        config = engine_config(model, **engine)
        self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()
        self._lora_keys: dict[LoRARequest, str] = {}

    def add_lora(self, lora_request: LoRARequest) -> str:
        """Load (or reload) an adapter from its path; returns its content hash.

        ``AdapterError`` (a ``ValueError``) says what is wrong with a bad adapter.
        """
        key = self.llm_engine.add_lora(lora_request.lora_name, lora_request.lora_path)
        self._lora_keys[lora_request] = key
        return key

    def remove_lora(self, lora_request: LoRARequest) -> None:
        key = self._lora_keys.pop(lora_request, None)
        if key is not None and key not in self._lora_keys.values():
            self.llm_engine.remove_lora(key)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def engine_stats(self) -> EngineStats:
        """KV blocks used/free, prefix-cache queries/hits, preemptions, steps."""
        return self.llm_engine.stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV block no request holds (benchmarks use it between runs)."""
        self.llm_engine.core.kv.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order.

        A prompt is a string or a list of token ids. ``sampling_params`` is one for all prompts
        or a list with one per prompt. ``lora_request`` is one adapter for all prompts, or a list
        with one entry per prompt (``None`` = the base model). ``priority`` is one for all
        prompts or one per prompt (lower runs earlier where the scheduling policy orders by
        priority; FCFS ignores it). Every prompt, adapter and structured-output constraint is
        validated before any request runs (``GrammarError`` for a constraint the backend cannot
        enforce).
        """
        engine = self.llm_engine
        items = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(
                    f"sampling_params has {len(params)} entries for {len(items)} prompts; "
                    "give one SamplingParams, or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(items)
        else:
            loras = list(lora_request)
            if len(loras) != len(items):
                raise ValueError(
                    f"lora_request has {len(loras)} entries for {len(items)} prompts; "
                    "give one LoRARequest, or one entry (or None) per prompt"
                )
        if isinstance(priority, int):
            priorities = [priority] * len(items)
        else:
            priorities = list(priority)
            if len(priorities) != len(items):
                raise ValueError(
                    f"priority has {len(priorities)} entries for {len(items)} prompts; "
                    "give one int, or one per prompt"
                )
        for lora in loras:
            if lora is not None and lora not in self._lora_keys:
                self.add_lora(lora)
        keys = [None if lora is None else self._lora_keys[lora] for lora in loras]
        tokenized = []
        for i, prompt in enumerate(items):
            try:
                ids = engine.tokenize(prompt)
                engine.validate_prompt(ids)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            tokenized.append(ids)
        checked: set[str] = set()
        for i, p in enumerate(params):
            constraint = p.structured_outputs
            if constraint is not None and constraint.key() not in checked:
                try:
                    engine.check_constraint(constraint)
                except ValueError as e:
                    raise type(e)(f"prompt {i}: {e}") from None
                checked.add(constraint.key())

        request_ids = [f"gen-{next(self._counter)}" for _ in items]
        for rid, prompt, ids, p, key, prio in zip(
            request_ids, items, tokenized, params, keys, priorities, strict=True
        ):
            text = prompt if isinstance(prompt, str) else None
            engine.add_tokenized_request(rid, text, ids, p, lora_key=key, priority=prio)
        return self._run(request_ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="generate", unit="req")
        try:
            while len(done) < len(wanted):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in wanted - done.keys():
                engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in request_ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if not items:
        raise ValueError("prompts is empty: give at least one prompt")
    if all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return [p if isinstance(p, str) else list(p) for p in items]
