"""What crosses the engine's boundary about the engine itself, as frozen records: what it is and
accepts (``EngineInfo``, told once at start), an adapter it loaded (``AdapterInfo``), and a
snapshot of its state (``EngineStats``, with its LoRA part). The platform reads these, never a
dict of string keys. No torch here: the platform imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from loraplex.lora.adapter import LoRAAdapter

Tier = Literal["device", "host", "disk"]
NO_TENANT = "-"  # the key of requests without a tenant (the operator, offline use) in stats


@dataclass(frozen=True)
class EngineInfo:
    """What the engine is and what it accepts, told once by the engine when it starts: the
    platform checks requests and uploads against these, never against copied defaults."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_blocks: int  # usable KV blocks (the reserved null block excluded): kv_blocks_total
    max_lora_rank: int  # the largest adapter rank the engine serves
    max_loras: int  # adapters one step may use (device slots)
    max_cpu_loras: int  # adapters kept in host memory
    lora_target_modules: tuple[str, ...]  # the modules an adapter may target on this model
    # the precision the engine runs in (``engine/models/precision.py``) and why it was picked
    dtype: str = "float32"
    dtype_reason: str = ""


@dataclass(frozen=True)
class AdapterInfo:
    key: str  # the adapter's content hash: its identity in the engine and in the prefix cache
    name: str
    rank: int
    target_modules: tuple[str, ...]
    size_bytes: int

    @classmethod
    def from_adapter(cls, adapter: LoRAAdapter) -> AdapterInfo:
        return cls(
            key=adapter.content_hash,
            name=adapter.name,
            rank=adapter.rank,
            target_modules=tuple(adapter.target_modules),
            size_bytes=adapter.size_bytes,
        )


@dataclass(frozen=True)
class LoRAStats:
    """The adapter cache: loads and evictions per tier (totals since the engine started), how
    many adapters each tier holds, where each registered adapter is, and the device page pool's
    usage (``pool_bytes_used`` against ``adapter_bytes``, the real size of what it holds)."""

    disk_loads: int = 0  # parsed from disk (added, or reloaded after a host eviction)
    host_hits: int = 0  # device loads served from host memory
    host_evictions: int = 0
    slot_loads: int = 0  # adapters copied into the device pool
    slot_hits: int = 0  # steps that found their adapter resident and in its slot already
    slot_evictions: int = 0  # adapters evicted from the device pool to make room
    load_waits: int = 0  # steps that waited for an adapter copy (0 while the scheduler gates)
    loads_deferred: int = 0  # waits for pool pages (full of adapters in use, pinned or fresh)
    load_failures: int = 0  # loads that failed (the adapter's requests ended with the reason)
    load_bytes: int = 0  # bytes copied into the device pool
    loads_in_flight: int = 0  # background copies now
    pool_pages: int = 0  # pages of every module's pool (one page: a rank-row in every layer)
    pool_pages_used: int = 0
    pool_bytes: int = 0  # the pool's device memory
    pool_bytes_used: int = 0  # of it, held by resident adapters
    adapter_bytes: int = 0  # the resident adapters' own weights (their ranks, no padding)
    resident_device: int = 0
    resident_host: int = 0
    registered: int = 0  # every adapter the engine knows (the disk tier)
    # content hash -> tier, for every registered adapter (None: an engine that counts only)
    residency: Mapping[str, Tier] | None = None
    # content hash -> why its load failed, for adapters failed now (until added again or
    # retried); their requests end with that reason
    failed: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AdapterRequests:
    """Requests on one adapter now (the samples of an ``n > 1`` request count once: as running
    while any of them runs, else as waiting)."""

    running: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class TenantStats:
    """One tenant's share of the engine: service since the engine started and its requests
    now. ``virtual_service`` is the fair policy's counter (weighted service: prompt tokens times
    ``fair_prompt_weight`` plus generated tokens times ``fair_output_weight``, each divided by
    the tenant's weight at the time, with the lifts of a returning tenant); None under a policy
    that keeps none."""

    virtual_service: float | None = None
    num_prompt_tokens_computed: int = 0  # recomputation after a preemption included
    num_generated_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    weight: float = 1.0  # the weight the engine holds for it now (set_tenant_weights)
    # adapter content hash -> this tenant's requests on it now; only adapters with some
    adapters: Mapping[str, AdapterRequests] = field(default_factory=dict)


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding since the engine started, for its one proposer (``method``): draft
    tokens verified, how many the target accepted, and the tokens the verifying steps emitted
    (accepted drafts plus the one token each verification samples, less any after a stop)."""

    method: str  # "ngram" | "draft_model": the metrics' label
    num_speculative_tokens: int = 0  # the most drafts a request gets in a step
    disable_by_batch_size: int = 0  # more decoding requests than this: no speculation that step
    num_verifications: int = 0  # (request, step) pairs that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_steps_off: int = 0  # steps with decoding requests where the batch was too large
    # [j]: verifications whose draft j + 1 was accepted (with all before it)
    accepted_per_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over draft tokens verified (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_emitted(self) -> float:
        """Tokens per verifying step of a request: 1 without any accepted draft."""
        n = self.num_verifications
        return self.num_emitted_tokens / n if n else 0.0


@dataclass(frozen=True)
class EngineStats:
    """One snapshot of the engine. Counters are totals since the engine process started (a
    restart starts them again; ``engine_restarts`` says when); gauges are current values.
    ``num_inflight`` and ``engine_restarts`` are the client's own."""

    num_running: int = 0  # samples (an n > 1 request counts n times)
    num_waiting: int = 0
    # requests (the samples of one count once: running while any of them runs, else waiting)
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    kv_cache_usage: float = 0.0  # fraction of the usable blocks in use
    block_size: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # ... and found
    prefix_cache_evictions: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0
    max_model_len: int = 0
    lora: LoRAStats | None = None  # None: the engine serves no adapters
    speculative: SpecDecodeStats | None = None  # None: no speculative decoding
    # tenant id (NO_TENANT for requests without one) -> its share: every tenant with a request
    # since the engine started, and every tenant given a weight
    tenants: Mapping[str, TenantStats] = field(default_factory=dict)
    dtype: str = ""  # the precision the engine runs in (EngineInfo.dtype_reason says why)
    num_inflight: int = 0
    engine_restarts: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0
