"""A scripted ``EngineClient`` for API tests: no model, deterministic tokens, recorded calls."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.engine.client import (
    AdapterInfo,
    EngineClient,
    EngineDeadError,
    EngineInfo,
    RequestDelta,
    check_tenant_weights,
    validate_prompt,
)
from loraplex.engine.info import EngineStats, LoRAStats
from loraplex.engine.records import TokenLogprobs
from loraplex.sampling_params import SamplingParams

EOS = 2
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FIRST_TOKEN = 10  # unseeded samples count up from here: t10 t11 t12 ...


@dataclass
class Submitted:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_key: str | None
    cache_extra_keys: tuple[str, ...]
    tenant: str | None = None
    priority: int = 0


@dataclass
class FakeEngineClient(EngineClient):
    """Sample ``j`` of a request emits one token per step: with a seed, tokens drawn from
    ``Random(seed + j)``; without, ``FIRST_TOKEN + step`` (plus ``100 * j``). ``eos_after``
    ends samples with EOS after that many tokens; ``die_after`` raises ``EngineDeadError`` after
    that many tokens; ``step_delay`` sleeps between tokens; ``queue_time`` rides on each sample's
    first delta. ``stats()`` answers ``engine_stats`` (after ``stats_delay`` seconds)."""

    model_dir: str
    max_model_len: int = 64
    vocab_size: int = 512
    max_lora_rank: int = 64
    eos_after: int | None = None
    die_after: int | None = None
    step_delay: float = 0.0
    queue_time: float | None = None
    alive: bool = True
    engine_stats: dict[str, Any] = field(
        default_factory=lambda: {
            "num_running": 0,
            "num_waiting": 0,
            "kv_blocks_used": 0,
            "kv_cache_usage": 0.0,
        }
    )
    stats_delay: float = 0.0
    submitted: list[Submitted] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    adapters: dict[str, AdapterInfo] = field(default_factory=dict)
    running_on: dict[str, int] = field(default_factory=dict)  # adapter key -> running requests
    started: bool = False
    tenant_weights: dict[str, float] | None = None  # the last set_tenant_weights (checked)
    retried: list[str] = field(default_factory=list)  # the keys of every retry_lora

    def __post_init__(self) -> None:
        self._init_adapters()
        self.info = EngineInfo(
            model_dir=self.model_dir,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=(EOS,),
            block_size=16,
            num_blocks=64,
            max_lora_rank=self.max_lora_rank,
            max_loras=4,
            max_cpu_loras=16,
            lora_target_modules=LORA_TARGET_MODULES,
        )

    async def start(self) -> None:
        self.started = True

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.started = False

    @property
    def healthy(self) -> bool:
        return self.alive

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        lora_key: str | None = None,
        cache_extra_keys: tuple[str, ...] = (),
        tenant: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        if not self.alive:
            raise EngineDeadError("the fake engine is dead")
        validate_prompt(self.info, prompt_token_ids)
        self._check_lora(lora_key)
        sub = Submitted(
            request_id,
            list(prompt_token_ids),
            params,
            lora_key,
            cache_extra_keys,
            tenant,
            priority,
        )
        return self._run(sub)

    async def _run(self, sub: Submitted) -> AsyncIterator[RequestDelta]:
        self._check_lora(sub.lora_key)
        self.submitted.append(sub)
        self._lora_request_started(sub.lora_key)
        key = sub.lora_key
        if key is not None:
            self.running_on[key] = self.running_on.get(key, 0) + 1
        params = sub.params
        n = params.n
        limit = self.max_model_len - len(sub.prompt_token_ids)
        max_tokens = min(params.max_tokens or limit, limit)
        rngs = [
            random.Random(params.seed + j) if params.seed is not None else None for j in range(n)
        ]
        done = [False] * n
        step = 0
        try:
            while not all(done):
                await asyncio.sleep(self.step_delay)
                if self.die_after is not None and step >= self.die_after:
                    raise EngineDeadError("the fake engine died mid-request")
                for j in range(n):
                    if done[j]:
                        continue
                    rng = rngs[j]
                    token = rng.randrange(10, 500) if rng else FIRST_TOKEN + step + 100 * j
                    finish = None
                    if self.eos_after is not None and step + 1 >= self.eos_after:
                        token, finish = EOS, "stop"
                    elif step + 1 >= max_tokens:
                        finish = "length"
                    logprobs = None
                    if params.logprobs is not None:
                        top = [(token, -0.5), (3, -1.5), (4, float("-inf"))][: params.logprobs]
                        logprobs = [TokenLogprobs(token, -0.5, 1, top)]
                    done[j] = finish is not None
                    queued = self.queue_time if step == 0 else None
                    yield RequestDelta(
                        sub.request_id, j, [token], logprobs, finish, None, 0, queued
                    )
                step += 1
            self.finished.append(sub.request_id)
        finally:
            if key is not None:
                self.running_on[key] -= 1
            self._lora_request_ended(sub.lora_key)
            if not all(done):
                self.aborted.append(sub.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        self.tenant_weights = check_tenant_weights(weights)  # refuses what the engine refuses

    async def _load_lora(self, name: str, path: str, pinned: bool) -> AdapterInfo:
        from loraplex.lora.adapter import AdapterError

        if not Path(path, "adapter_config.json").is_file():
            raise AdapterError("missing_file", f"{path} has no adapter_config.json")
        key = hashlib.sha256(Path(path, "adapter_config.json").read_bytes()).hexdigest()
        info = AdapterInfo(key, name, 8, ("q_proj", "v_proj"), 4096)
        self.adapters[key] = info
        return info

    async def retry_lora(self, key: str) -> bool:
        """Clears ``key`` from the scripted failures (``engine_stats["lora_failed"]``)."""
        self.retried.append(key)
        failed = dict(self.engine_stats.get("lora_failed") or {})
        had = failed.pop(key, None) is not None
        if had:
            self.engine_stats["lora_failed"] = failed
        return had

    def lose_adapter(self, key: str) -> None:
        """The engine loses its copy, as when a restart cannot load it again."""
        self.adapters.pop(key, None)
        self._loras.drop(key)

    async def _unload_lora(self, key: str) -> None:
        if self.running_on.get(key):  # as the engine core does
            raise ValueError(f"adapter {key[:12]} is in use by {self.running_on[key]} request(s)")
        self.adapters.pop(key, None)

    async def stats(self) -> dict[str, Any]:
        if not self.alive:
            raise EngineDeadError("the fake engine is dead")
        await asyncio.sleep(self.stats_delay)
        return stats_from_flat(self.engine_stats)


# lora_<field> -> LoRAStats field: every field, so a new one is scriptable at once
_LORA_KEYS = {f"lora_{f.name}": f.name for f in dataclasses.fields(LoRAStats)}


def stats_from_flat(flat: dict[str, Any]) -> EngineStats:
    """An ``EngineStats`` from the flat names tests script (``lora_registered`` and the like
    for its LoRA part, present only when one of them is given)."""
    known = {f.name for f in dataclasses.fields(EngineStats)}
    unknown = set(flat) - known - set(_LORA_KEYS) - {"prefix_cache_hit_rate"}
    assert not unknown, f"not EngineStats fields: {sorted(unknown)}"
    lora = {_LORA_KEYS[k]: v for k, v in flat.items() if k in _LORA_KEYS}
    top = {k: v for k, v in flat.items() if k in known}
    if "prefix_cache_hit_rate" in flat and "prefix_cache_queries" not in flat:  # a scripted rate
        top["prefix_cache_queries"], top["prefix_cache_hits"] = (
            1000,
            round(1000 * flat["prefix_cache_hit_rate"]),
        )
    return EngineStats(**top, lora=LoRAStats(**lora) if lora else None)
