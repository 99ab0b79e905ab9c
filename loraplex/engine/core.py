"""The engine core: one scheduler, one model runner, and the step that joins them."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from loraplex.config import EngineConfig
from loraplex.engine.adapter_residency import AdapterResidency
from loraplex.engine.info import (
    NO_TENANT,
    AdapterRequests,
    EngineInfo,
    EngineStats,
    LoRAStats,
    TenantStats,
)
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.models.parallel import SINGLE
from loraplex.engine.records import EngineCoreOutput
from loraplex.engine.request import Request
from loraplex.engine.runner import ModelRunner
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.spec.build import build_proposer, build_spec_decoder
from loraplex.engine.spec.decoder import SpecDecoder
from loraplex.engine.structured import MASK_TOKENS_PER_SECOND, StructuredOutputs
from loraplex.engine.tensor_parallel import WorkerGroup
from loraplex.engine.thread_governor import ThreadGovernor
from loraplex.grammar import GrammarBackend, LLGuidanceBackend
from loraplex.lora.adapter import LoRAAdapter
from loraplex.lora.errors import AdapterError
from loraplex.lora.pool import PoolFullError

logger = logging.getLogger(__name__)


class EngineCore:
    @classmethod
    def build(
        cls, config: EngineConfig, model_dir: str, tokenizer: Any | None = None
    ) -> tuple[EngineCore, EngineInfo]:
        """The engine factory: build the core and describe it. EOS ids: the model's plus the
        tokenizer's (loaded from ``model_dir`` when not given), so every client stops where
        ``LLM.generate`` stops."""
        if tokenizer is None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(model_dir)
            except Exception:  # a directory without a tokenizer still serves token ids
                tokenizer = None
        core = cls(config, model_dir, tokenizer=tokenizer)
        eos = list(core.eos_token_ids)
        lora = config.lora
        info = EngineInfo(
            model_dir=model_dir,
            max_model_len=core.max_model_len,
            vocab_size=core.vocab_size,
            eos_token_ids=tuple(eos),
            block_size=core.kv.block_size,
            num_blocks=core.kv.num_usable_blocks,
            max_lora_rank=lora.max_lora_rank,
            max_loras=lora.max_loras,
            max_cpu_loras=lora.max_cpu_loras,
            lora_target_modules=core.lora_target_modules,
            dtype=core.runner.precision.name,
            dtype_reason=core.runner.precision.reason,
        )
        return core, info

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        tokenizer: Any | None = None,
        grammar_backend: Callable[[], GrammarBackend] | None = None,
    ):
        """``tokenizer``: the model's (loaded from ``model_dir`` when a constraint first needs
        it); ``grammar_backend``: builds the structured-output backend (default: llguidance
        for the tokenizer, the model's vocabulary and the EOS ids)."""
        self.config = config
        self.model_dir = model_dir
        self._tokenizer = tokenizer
        self.workers: WorkerGroup | None = None  # tensor parallelism: ranks 1..N-1
        tp = SINGLE
        if config.model.tensor_parallel_size > 1:
            self.workers, tp = WorkerGroup.start(config, model_dir)
        try:
            self.runner = ModelRunner(
                config.model,
                config.cache,
                config.scheduler,
                model_dir,
                lora_config=config.lora,
                tp=tp,
                followers=self.workers,
            )
            self._init_after_runner(config, tokenizer, grammar_backend)
        except BaseException:
            self.close()
            raise

    def _init_after_runner(
        self,
        config: EngineConfig,
        tokenizer: Any | None,
        grammar_backend: Callable[[], GrammarBackend] | None,
    ) -> None:
        spec = self.runner.spec
        # A draft model takes its memory before the served model's KV cache is sized.
        proposer = None
        if config.speculative_config is not None:
            longest = config.model.max_model_len or spec.max_position_embeddings
            proposer = build_proposer(config, spec.vocab_size, longest)
        num_blocks = self.runner.init_kv_cache()
        block_size = config.cache.block_size
        max_model_len = config.model.max_model_len or spec.max_position_embeddings
        capacity = (num_blocks - 1) * block_size
        if capacity < max_model_len:
            if config.model.max_model_len is not None:
                raise ValueError(
                    f"the KV cache holds {capacity} tokens ({num_blocks - 1} blocks of "
                    f"{block_size}), less than max_model_len={max_model_len}; give it more "
                    "memory (kv_cache_memory / num_blocks) or lower max_model_len"
                )
            logger.info("max_model_len lowered to %d to fit the KV cache", capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.vocab_size = spec.vocab_size
        lora = self.runner.lora
        self.lora_target_modules: tuple[str, ...] = lora.target_modules if lora else ()
        eos = list(spec.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int) and tok_eos not in eos:
            eos.append(tok_eos)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)  # the model's, then the tokenizer's
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.structured = StructuredOutputs(grammar_backend or self._grammar_backend)
        # Where each adapter is and may be: decided here (torch-free), carried out by the runner.
        self.adapters: AdapterResidency | None = None
        if lora is not None:
            self.adapters = AdapterResidency(
                lora.pages_per_module(), config.lora.max_cpu_loras, config.lora.max_loras
            )
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            max_model_len,
            max_loras=config.lora.max_loras,
            constraints=self.structured,
            residency=self.adapters,
        )
        waiting = self.scheduler.waiting
        self.structured.on_mask_cost = lambda tenant, seconds: waiting.charge_work(
            tenant, seconds * MASK_TOKENS_PER_SECOND
        )
        self.spec: SpecDecoder | None = None
        if proposer is not None and config.speculative_config is not None:
            self.spec = build_spec_decoder(
                config.speculative_config, proposer, self.runner.device.type, max_model_len
            )
        self.governor = _thread_governor(self.runner.device.type)

    def _grammar_backend(self) -> GrammarBackend:
        """The default backend (on a compile thread, at the first constrained request)."""
        tokenizer = self._tokenizer
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return LLGuidanceBackend(tokenizer, self.vocab_size, self.eos_token_ids)

    # ---- adapters --------------------------------------------------------------------------

    def add_lora(self, name: str, path: str, pinned: bool = False) -> LoRAAdapter:
        """Load and validate an adapter (``AdapterError`` when bad); returns it (key: its hash).
        A pinned adapter is copied into the device pool now and never evicted from it."""
        store, residency = self.runner.lora, self.adapters
        assert store is not None and residency is not None
        adapter, reg = store.add_adapter(path, name)
        try:
            residency.register(reg.key, name, reg.ranks, reg.nbytes)
        except PoolFullError as exc:
            raise AdapterError(
                "pool_too_small",
                f"adapter {name!r} does not fit the device adapter pool: {exc}; raise "
                "--lora-memory",
            ) from exc
        if self.workers is not None:  # every rank keeps its share (read from the same files)
            try:
                self.workers.add_adapter(name, path)
            except BaseException:
                self.remove_lora(reg.key)
                raise
        if pinned:
            self._pin(reg.key)
        return adapter

    def _pin(self, key: str) -> None:
        """Pin ``key`` and copy it into the pool before returning (``RuntimeError`` when the
        pool has no room without evicting adapters in use or pinned)."""
        store, residency = self.runner.lora, self.adapters
        assert store is not None and residency is not None
        residency.pin(key)
        order = residency.reserve_now(key, self.scheduler.slots.holds)
        if order is not None:
            result = store.load_now(order)
            residency.loaded(result)
            if result.error is not None:
                residency.pin(key, False)
                raise RuntimeError(residency.failure(key) or result.error)

    def remove_lora(self, key: str) -> None:
        """Forget an adapter. Refused while requests still use it."""
        reqs = [*self.scheduler.requests.values(), *self.structured.waiting_requests()]
        users = [r.request_id for r in reqs if r.lora_key == key]
        if users:
            raise ValueError(
                f"adapter {key[:12]} is in use by {len(users)} request(s); wait for them to "
                "finish or abort them, then remove it"
            )
        assert self.runner.lora is not None and self.adapters is not None
        self.adapters.forget(key)
        self.runner.lora.forget(key)

    def has_lora(self, key: str) -> bool:
        return self.adapters is not None and self.adapters.has(key)

    def retry_lora(self, key: str) -> bool:
        """Forget ``key``'s load failure: its next request loads it again. False when it had
        none."""
        return self.adapters is not None and self.adapters.retry(key)

    def add_request(self, req: Request) -> None:
        """Queue ``req`` (``ValueError`` when it cannot be served). A request with a
        constraint waits in ``structured`` until its grammar is compiled."""
        if req.params.structured_outputs is not None:
            self.scheduler.check_request(req)
            if not self.structured.admit(req):
                return
        try:
            self.scheduler.add_request(req)
        except Exception:
            self.structured.forget(req.request_id)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(self.structured.abort(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.structured.num_waiting > 0

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """Tenant id -> share weight for the fair policy, from the next step on (``ValueError``
        for a weight that is not a finite number above 0)."""
        self.scheduler.set_tenant_weights(weights)

    def step(self) -> list[EngineCoreOutput]:
        outputs = self._release_compiled()
        if not self.scheduler.has_unfinished_requests():
            if not self.structured.num_waiting:
                return outputs
            self.structured.wait()  # nothing to run but compiles: wait for one, never spin
            outputs += self._release_compiled()
            if not self.scheduler.has_unfinished_requests():
                return outputs
        if self.governor is not None:
            self.governor.step_started()
        out = self.scheduler.schedule()
        self.structured.fill_masks(out)
        result = self.runner.execute(out)
        new = self.scheduler.update(out, result)
        if self.spec is not None:  # the next step's drafts
            self.spec.after_step(out, result, new, self.scheduler.running)
        if self.governor is not None:
            self.governor.step_finished()
        return outputs + new

    def _release_compiled(self) -> list[EngineCoreOutput]:
        """Requests whose grammar compiled go to the scheduler; those whose grammar failed
        finish here with the error."""
        ready, failed = self.structured.take_ready()
        outputs: list[EngineCoreOutput] = []
        for req in ready:
            try:
                self.scheduler.add_request(req)
            except ValueError as exc:  # checked at add_request; a duplicate id meanwhile
                failed.append((req, str(exc)))
        for req, why in failed:
            self.structured.forget(req.request_id)
            outputs.append(
                EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[],
                    finish_reason="error",
                    queue_time=req.queue_time,
                    error=why,
                )
            )
        return outputs

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also done at exit)."""
        if self.workers is not None:
            self.workers.close()

    def stats(self) -> EngineStats:
        kv, sched = self.kv, self.scheduler
        running, waiting = self._request_groups()
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting + self.structured.num_waiting,
            num_running_requests=len(running),
            num_waiting_requests=len(waiting),
            kv_blocks_total=kv.num_usable_blocks,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_blocks_cached=kv.num_cached_blocks,
            kv_cache_usage=kv.usage,
            block_size=kv.block_size,
            prefix_cache_queries=kv.stats.prefix_queries,
            prefix_cache_hits=kv.stats.prefix_hits,
            prefix_cache_evictions=kv.stats.evictions,
            num_preemptions=sched.stats.num_preemptions,
            num_steps=sched.stats.num_steps,
            num_prompt_tokens_computed=sched.stats.num_prompt_tokens_computed,
            num_generated_tokens=sched.stats.num_generated_tokens,
            max_model_len=self.max_model_len,
            lora=self._lora_stats(),
            speculative=None if self.spec is None else self.spec.stats(),
            tenants=self._tenant_stats(running, waiting),
            dtype=self.runner.precision.name,
        )

    def _request_groups(self) -> tuple[dict[str, Request], dict[str, Request]]:
        """Running and waiting requests, one sample each: a request (its samples share the
        leader's id as ``parent_id``) runs while any sample runs; else it waits."""
        sched = self.scheduler
        running = {r.parent_id or r.request_id: r for r in sched.running}
        waiting: dict[str, Request] = {}
        for r in [*sched.waiting_requests(), *self.structured.waiting_requests()]:
            group = r.parent_id or r.request_id
            if group not in running:
                waiting.setdefault(group, r)
        return running, waiting

    def _tenant_stats(
        self, running_requests: dict[str, Request], waiting_requests: dict[str, Request]
    ) -> dict[str, TenantStats]:
        sched = self.scheduler
        running = Counter(r.tenant for r in sched.running)
        waiting = Counter(
            r.tenant for r in [*sched.waiting_requests(), *self.structured.waiting_requests()]
        )
        on_adapters = _adapter_requests(running_requests.values(), waiting_requests.values())
        counters = sched.waiting.virtual_service()
        usage = sched.stats.tenants
        tenants: dict[str, TenantStats] = {}
        seen = {*usage, *running, *waiting, *(counters or ()), *sched.tenant_weights}
        for tenant in sorted(seen, key=lambda t: (t is not None, t or "")):
            used = usage.get(tenant)
            tenants[NO_TENANT if tenant is None else tenant] = TenantStats(
                virtual_service=None if counters is None else counters.get(tenant, 0.0),
                num_prompt_tokens_computed=used.num_prompt_tokens_computed if used else 0,
                num_generated_tokens=used.num_generated_tokens if used else 0,
                num_running=running[tenant],
                num_waiting=waiting[tenant],
                weight=1.0 if tenant is None else sched.tenant_weights.get(tenant, 1.0),
                adapters=on_adapters.get(tenant, {}),
            )
        return tenants

    def _lora_stats(self) -> LoRAStats | None:
        store, residency = self.runner.lora, self.adapters
        if store is None or residency is None:
            return None
        counts = residency.counts()
        rs = residency.stats
        pool = residency.pool
        geo = store.geometry
        used = pool.pages_used_by_module()
        return LoRAStats(
            disk_loads=store.stats.adds + rs.disk_loads,
            host_hits=rs.host_hits,
            host_evictions=rs.host_evictions,
            slot_loads=rs.slot_loads,
            slot_hits=store.stats.slot_hits,
            slot_evictions=pool.counters.evictions,
            load_waits=0,  # no step waits for a copy: admission takes ready adapters only
            loads_deferred=rs.loads_deferred,
            load_failures=rs.load_failures,
            load_bytes=rs.load_bytes,
            loads_in_flight=residency.loads_in_flight,
            pool_pages=pool.pages_total(),
            pool_pages_used=sum(used.values()),
            pool_bytes=0 if geo is None else geo.bytes_total,
            pool_bytes_used=0
            if geo is None
            else sum(n * geo.page_bytes[m] for m, n in used.items()),
            adapter_bytes=residency.adapter_bytes(),
            resident_device=counts["device"],
            resident_host=counts["host"],
            registered=counts["registered"],
            residency=residency.tiers(),
            failed=residency.failed(),
        )


def _adapter_requests(
    running: Iterable[Request], waiting: Iterable[Request]
) -> dict[str | None, dict[str, AdapterRequests]]:
    """tenant -> adapter key -> its requests running and waiting (one sample per request)."""
    counts: dict[tuple[str | None, str], list[int]] = {}
    for column, requests in enumerate((running, waiting)):
        for r in requests:
            if r.lora_key is not None:
                counts.setdefault((r.tenant, r.lora_key), [0, 0])[column] += 1
    out: dict[str | None, dict[str, AdapterRequests]] = {}
    for (tenant, key), (n_running, n_waiting) in sorted(
        counts.items(), key=lambda kv: (kv[0][0] or "", kv[0][1])
    ):
        out.setdefault(tenant, {})[key] = AdapterRequests(n_running, n_waiting)
    return out


GOVERNOR_ENV = "LORAPLEX_THREAD_GOVERNOR"


def _thread_governor(device_type: str) -> ThreadGovernor | None:
    """On the CPU with more than one thread: fewer threads while a neighbour holds the cores
    (``engine/thread_governor.py``); ``LORAPLEX_THREAD_GOVERNOR=0`` keeps the count fixed."""
    import os

    import torch

    if device_type != "cpu" or os.environ.get(GOVERNOR_ENV, "1").strip() == "0":
        return None
    threads = torch.get_num_threads()
    return ThreadGovernor(threads, torch.set_num_threads) if threads > 1 else None
