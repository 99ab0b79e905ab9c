"""LLMEngine: tokenizer + input validation + the engine core + output processing, in one
process. The offline ``LLM`` class and the in-process engine client are built on it."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from loraplex.config import EngineConfig
from loraplex.engine.client import build_core_requests, validate_prompt
from loraplex.engine.default_model import resolve_model_dir
from loraplex.engine.info import EngineStats
from loraplex.engine.output_processor import OutputProcessor
from loraplex.outputs import RequestOutput
from loraplex.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        start = time.perf_counter()
        self.config = config
        self.model_dir = resolve_model_dir(config.model.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        from loraplex.engine.core import EngineCore  # torch: only once an engine is built

        self.core, self.info = EngineCore.build(config, self.model_dir, self.tokenizer)
        self.eos_token_ids = frozenset(self.info.eos_token_ids)
        self.processor = OutputProcessor(self.tokenizer)
        self.load_seconds = time.perf_counter() - start

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: send at least one token")
            return list(self.tokenizer(prompt).input_ids)
        return list(prompt)

    def validate_prompt(self, token_ids: list[int]) -> None:
        """Raise ValueError naming the field for a prompt the engine cannot serve."""
        validate_prompt(self.info, token_ids)

    def check_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Compile ``constraint`` now (cached): ``GrammarError`` (a ValueError) when it cannot
        be enforced. A request that carries it is then scheduled without waiting."""
        self.core.structured.check(constraint)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        cache_extra_keys: tuple[str, ...] = (),
        lora_key: str | None = None,
        detokenize: bool = True,
        tenant: str | None = None,
        priority: int = 0,
    ) -> None:
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        self.add_tokenized_request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            token_ids,
            params,
            cache_extra_keys=cache_extra_keys,
            lora_key=lora_key,
            detokenize=detokenize,
            tenant=tenant,
            priority=priority,
        )

    def add_tokenized_request(
        self,
        request_id: str,
        prompt: str | None,
        token_ids: list[int],
        params: SamplingParams,
        *,
        cache_extra_keys: tuple[str, ...] = (),
        lora_key: str | None = None,
        detokenize: bool = True,
        tenant: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a validated prompt. ``lora_key`` is an added adapter's content hash; it joins
        the prefix-cache extra keys, so adapters (and the base model) never share KV.
        ``tenant`` and ``priority`` (lower runs earlier) are for the scheduling policy."""
        if lora_key is not None and not self.core.has_lora(lora_key):
            raise ValueError(f"adapter {lora_key[:12]} is not loaded; add it first")
        if self.processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        self.processor.add_request(request_id, prompt, token_ids, params, detokenize)
        for req in build_core_requests(
            request_id,
            token_ids,
            params,
            self.eos_token_ids,
            lora_key=lora_key,
            cache_extra_keys=cache_extra_keys,
            tenant=tenant,
            priority=priority,
        ):
            self.core.add_request(req)

    def add_lora(self, name: str, path: str, pinned: bool = False) -> str:
        """Load and validate an adapter; returns its content hash (its key in the engine)."""
        return self.core.add_lora(name, path, pinned=pinned).content_hash

    def remove_lora(self, key: str) -> None:
        self.core.remove_lora(key)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.core.abort_requests(self.processor.unfinished_sample_ids(request_id))
        return self.processor.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.processor.num_unfinished > 0 or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.core.step()
        results, to_abort = self.processor.process(outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return results

    def stats(self) -> EngineStats:
        return self.core.stats()

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """Tenant id -> share weight for the "fair" policy, from the next step on."""
        self.core.set_tenant_weights(weights)
