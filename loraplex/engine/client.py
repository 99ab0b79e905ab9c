"""EngineClient: the async interface between the platform (HTTP server) and the engine core.

Two implementations share everything but the transport (``StreamingClient`` below):
``InprocEngineClient`` steps an ``EngineCore`` in this process; ``ProcEngineClient`` runs it in a
supervised child process. Clients deal in token ids only: the server tokenizes, detokenizes and
applies stop strings (calling ``abort`` when one matches).

This module imports no torch, so the server can import it cheaply.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Container, Mapping
from dataclasses import dataclass, field

from loraplex.engine.adapter_table import OPERATOR_OWNER, AdapterTable, Release
from loraplex.engine.admission import check_tenant_weights
from loraplex.engine.info import NO_TENANT, AdapterInfo, EngineInfo, EngineStats, TenantStats
from loraplex.engine.output_processor import sample_ids
from loraplex.engine.records import EngineCoreOutput, TokenLogprobs
from loraplex.engine.request import Request
from loraplex.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "NO_TENANT",
    "OPERATOR_OWNER",
    "AdapterInfo",
    "AdapterNotLoadedError",
    "EngineClient",
    "EngineDeadError",
    "EngineInfo",
    "EngineStartupError",
    "EngineStats",
    "Release",
    "RequestDelta",
    "StreamingClient",
    "TenantStats",
    "build_core_requests",
    "check_tenant_weights",
    "validate_prompt",
]


@dataclass
class RequestDelta:
    """One step's news for one sample of a request."""

    request_id: str  # the caller's id
    index: int  # sample index 0..n-1
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None
    num_cached_tokens: int
    queue_time: float | None = None  # seconds the sample waited to be scheduled (first delta)
    # finish_reason "error": why the engine could not serve it (a structured-output constraint
    # that failed to compile, or whose matcher failed, or its adapter failed to load); the
    # request is lost, the engine is fine
    error: str | None = None
    error_code: str | None = None  # "adapter_failed", or None (a constraint's error)


class EngineDeadError(RuntimeError):
    """The engine died (or is restarting / shut down): the request is lost; retry it later."""


class EngineStartupError(RuntimeError):
    """The engine could not start (bad model directory, too little KV memory, ...)."""


class AdapterNotLoadedError(ValueError):
    """``generate`` named an adapter the engine holds for no owner (removed, or never added)."""


class EngineClient(ABC):
    """The engine's front for the platform. Adapters are reference-counted by owner (see
    ``adapter_table``): ``add_lora`` / ``retain_lora`` take a reference, ``release_lora`` drops
    one; the engine copy goes with the last reference, once no request uses it. Subclasses call
    ``_init_adapters`` when built, ``_lora_request_started`` / ``_lora_request_ended`` around
    each request on an adapter, and provide the engine calls ``_load_lora`` / ``_unload_lora``.
    """

    info: EngineInfo  # available after start()
    _loras: AdapterTable
    _lora_lock: asyncio.Lock  # held across every engine call that adds or removes an adapter
    _retiring: set[asyncio.Task[None]]

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting; let in-flight requests finish up to ``timeout``, abort the rest, stop
        the engine. Idempotent."""

    @abstractmethod
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
    ) -> AsyncGenerator[RequestDelta, None]:
        """Yield deltas until every sample finished. Bad input raises ``ValueError`` at the call;
        a dead engine ``EngineDeadError``. When the consumer stops iterating (``aclose``,
        cancellation) the request is aborted in the engine at once and its KV blocks freed.

        ``tenant`` (an opaque id) and ``priority`` (lower runs earlier) are for the engine's
        scheduling policy; neither changes what is generated."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort every unfinished sample; each yields a last delta with finish_reason "abort"."""

    # ---- adapters ----------------------------------------------------------------------

    def _init_adapters(self) -> None:
        self._loras = AdapterTable()
        self._lora_lock = asyncio.Lock()
        self._retiring = set()

    @abstractmethod
    async def _load_lora(self, name: str, path: str, pinned: bool) -> AdapterInfo:
        """The engine call: load and validate the adapter at ``path`` (``AdapterError``)."""

    @abstractmethod
    async def _unload_lora(self, key: str) -> None:
        """The engine call: forget ``key`` (``ValueError`` while the engine still runs
        requests on it)."""

    @abstractmethod
    async def retry_lora(self, key: str) -> bool:
        """Forget the load failure of adapter ``key`` (content hash): its next request loads it
        again. False when it had none."""

    async def add_lora(
        self, name: str, path: str, pinned: bool = False, *, owner: str = OPERATOR_OWNER
    ) -> AdapterInfo:
        """Load and validate an adapter for ``owner``; raises ``AdapterError`` (with its
        ``code``) when bad. Loading content the engine already holds adds a reference."""
        async with self._lora_lock:
            info = await self._load_lora(name, path, pinned)
            self._loras.record(info, name, path, pinned, owner)
        return info

    def retain_lora(self, key: str, owner: str, path: str) -> bool:
        """Add ``owner``'s reference to the engine's copy of ``key`` (read from ``path`` once
        the others let go); False when the engine holds no such copy: ``add_lora`` it."""
        return self._loras.retain(key, owner, path)

    def has_lora(self, key: str) -> bool:
        """Whether new requests may use ``key``."""
        return self._loras.usable(key)

    def lora_owners(self, key: str) -> frozenset[str]:
        return self._loras.owners(key)

    def lora_keys(self, owner: str) -> list[str]:
        """The adapters ``owner`` holds a reference to."""
        return self._loras.keys_of(owner)

    async def release_lora(self, key: str, *, owner: str = OPERATOR_OWNER) -> Release:
        """Drop ``owner``'s reference to ``key``. The engine copy stays while another owner
        holds it, and while requests run on it (new ones are refused); ``removed`` resolves
        True once it is gone, False when another reference kept it."""
        async with self._lora_lock:
            release = self._loras.release(key, owner)
            if release.repoint is not None:
                held = self._loras.get(key)
                assert held is not None
                # The engine re-reads the files of an owner that still holds them (a dead
                # engine's restart loads it from the new source).
                with contextlib.suppress(EngineDeadError):
                    await self._load_lora(held.name, release.repoint, held.pinned)
            if release.remove_now:
                await self._remove_retired(key)
        return release

    async def remove_lora(self, key: str) -> None:
        """The operator's unload: drops the operator's reference; refused (``ValueError``)
        while requests use the adapter and no other owner keeps it."""
        held = self._loras.get(key)
        if held is not None and held.users and held.paths.keys() <= {OPERATOR_OWNER}:
            raise ValueError(
                f"adapter {held.name!r} is in use by {held.users} request(s); wait for them "
                "to finish or abort them, then remove it"
            )
        await self.release_lora(key, owner=OPERATOR_OWNER)

    def _check_lora(self, lora_key: str | None) -> None:
        if lora_key is not None and not self._loras.usable(lora_key):
            raise AdapterNotLoadedError(f"adapter {lora_key[:12]} is not loaded; add it first")

    def _checked_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        in_use: Container[str],
        *,
        lora_key: str | None,
        cache_extra_keys: tuple[str, ...],
        tenant: str | None,
        priority: int,
    ) -> list[Request]:
        """What ``generate`` checks of its arguments before anything is queued (the caller has
        checked that it serves): the prompt against the engine's limits, the adapter, the id
        against ``in_use``; then the core requests (bad sampling parameters raise here)."""
        validate_prompt(self.info, prompt_token_ids)
        self._check_lora(lora_key)
        if request_id in in_use:
            raise ValueError(f"request id {request_id!r} is already in use")
        return build_core_requests(
            request_id,
            prompt_token_ids,
            params,
            frozenset(self.info.eos_token_ids),
            lora_key=lora_key,
            cache_extra_keys=cache_extra_keys,
            tenant=tenant,
            priority=priority,
        )

    def _lora_request_started(self, lora_key: str | None) -> None:
        if lora_key is not None:
            self._loras.started(lora_key)

    def _lora_request_ended(self, lora_key: str | None) -> None:
        if lora_key is not None and self._loras.ended(lora_key):
            task = asyncio.get_running_loop().create_task(self._retire(lora_key))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _retire(self, key: str) -> None:
        async with self._lora_lock:
            if self._loras.removal_due(key):
                await self._remove_retired(key)

    async def _remove_retired(self, key: str) -> None:
        """Remove a copy no owner holds and no request uses (call with the lock held)."""
        for attempt in range(50):
            try:
                await self._unload_lora(key)
                break
            except EngineDeadError:
                break  # a dead engine forgets its adapters; the restart does not add it
            except ValueError:  # the engine still runs an aborted request: it goes next step
                if attempt == 49:
                    logger.error("adapter %s stays in the engine: still in use", key[:12])
                    return
                await asyncio.sleep(0.02)
        self._loras.drop(key)

    @abstractmethod
    async def stats(self) -> EngineStats:
        """The engine's snapshot, with this client's ``num_inflight`` and ``engine_restarts``."""

    @abstractmethod
    async def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        """Tenant id -> share weight for the engine's "fair" scheduling policy: a tenant of
        weight 3 gets three times the service of a tenant of weight 1 while both wait for
        the engine. A tenant not named weighs 1.0. Replaces the weights given before; the
        engine uses them from its next step on, and an engine that restarts gets them again.
        ``ValueError`` at the call for a weight that is not a finite number above 0. Other
        policies hold them (``EngineStats.tenants``) but do not use them."""

    @property
    @abstractmethod
    def healthy(self) -> bool: ...

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the engine is not serving (for ``/health``); None while it is healthy."""
        return None if self.healthy else "the engine is not running"


def validate_prompt(info: EngineInfo, token_ids: list[int]) -> None:
    """Raise ValueError naming the field for a prompt the engine cannot serve.

    Same rules and messages as ``LLMEngine.validate_prompt``, from ``EngineInfo`` alone.
    """
    if not token_ids:
        raise ValueError("prompt is empty: send at least one token")
    vocab = info.vocab_size
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise ValueError(
                f"prompt_token_ids holds {t!r}, which is not a token id of this model "
                f"(valid ids are integers 0..{vocab - 1})"
            )
    if len(token_ids) >= info.max_model_len:
        raise ValueError(
            f"prompt is {len(token_ids)} tokens long, but this model's context "
            f"(max_model_len) is {info.max_model_len} tokens, and at least one must be left "
            "for the output; shorten the prompt"
        )
    if -(-(len(token_ids) + 1) // info.block_size) > info.num_blocks:
        raise ValueError(
            f"prompt is {len(token_ids)} tokens long and does not fit in the KV cache "
            f"({info.num_blocks * info.block_size} tokens); "
            "shorten it or give the engine more KV memory"
        )


def build_core_requests(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    *,
    lora_key: str | None,
    cache_extra_keys: tuple[str, ...],
    tenant: str | None = None,
    priority: int = 0,
) -> list[Request]:
    """The engine-core requests of one request: one per sample (ids from ``sample_ids``).

    The adapter's content hash joins the prefix-cache extra keys, so adapters (and the base
    model) never share KV, exactly as in ``LLMEngine.add_tokenized_request``. Every sample
    carries the request's ``tenant`` and ``priority``.
    """
    if lora_key is not None:
        cache_extra_keys = (f"lora:{lora_key}", *cache_extra_keys)
    ids = sample_ids(request_id, params.n)
    return [
        Request(
            sid,
            list(prompt_token_ids),
            params.for_child(i) if params.n > 1 else params,
            eos_token_ids=eos_token_ids,
            cache_extra_keys=cache_extra_keys,
            lora_key=lora_key,
            tenant=tenant,
            priority=priority,
            parent_id=ids[0] if i else None,
        )
        for i, sid in enumerate(ids)
    ]


@dataclass(eq=False)
class _Stream:
    """The client-side state of one in-flight request."""

    request_id: str
    queue: asyncio.Queue[RequestDelta | BaseException]
    lora_key: str | None
    unfinished: dict[str, int] = field(default_factory=dict)  # sample id -> index


class StreamingClient(EngineClient):
    """Request bookkeeping shared by both clients; subclasses provide the transport.

    Runs on one event loop. Invariant: a stream is in ``_streams`` (and its unfinished samples in
    ``_sample_of``) exactly while the engine may still produce outputs for it; finished, aborted
    and failed streams are removed at once, so late outputs for them are dropped.
    """

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._sample_of: dict[str, _Stream] = {}
        self._init_adapters()
        self._accepting = True
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._started = False
        self._shutdown: asyncio.Task[None] | None = None
        self.engine_restarts = 0
        self._tenant_weights: dict[str, float] = {}  # the last given; a new engine gets them

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Idempotent: later and concurrent calls wait for the first one's shutdown."""
        if self._shutdown is None:
            self._shutdown = asyncio.create_task(self._do_shutdown(timeout))
        await asyncio.shield(self._shutdown)

    @abstractmethod
    async def _do_shutdown(self, timeout: float) -> None:
        """Drain for up to ``timeout`` seconds, abort the rest, stop the engine."""

    # ---- transport, provided by subclasses -------------------------------------------------

    @abstractmethod
    def _send_requests(self, requests: list[Request]) -> None:
        """Hand the requests to the engine (non-blocking)."""

    @abstractmethod
    def _send_abort(self, sample_ids: list[str]) -> None:
        """Abort these engine-core requests (non-blocking); their blocks are freed before the
        engine's next step and before any later call is served."""

    # ---- the public request API ------------------------------------------------------------

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
    ) -> AsyncGenerator[RequestDelta, None]:
        self._check_serving()
        requests = self._checked_requests(
            request_id, prompt_token_ids, params, self._streams, lora_key=lora_key,
            cache_extra_keys=cache_extra_keys, tenant=tenant, priority=priority,
        )  # fmt: skip
        return self._run(request_id, requests)

    async def _run(
        self, request_id: str, requests: list[Request]
    ) -> AsyncGenerator[RequestDelta, None]:
        # Submitted on first iteration, so an iterator that is never iterated leaks nothing.
        self._check_serving()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora_key = requests[0].lora_key if requests else None
        self._check_lora(lora_key)  # it may have been removed since ``generate``
        stream = _Stream(request_id, asyncio.Queue(), lora_key)
        for i, req in enumerate(requests):
            stream.unfinished[req.request_id] = i
            self._sample_of[req.request_id] = stream
        self._streams[request_id] = stream
        self._lora_request_started(lora_key)
        self._idle.clear()
        remaining = len(requests)
        try:
            self._send_requests(requests)
            while remaining:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            if stream.unfinished:
                self._abort_stream(stream)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._abort_stream(stream)

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    def _with_client_stats(self, stats: EngineStats) -> EngineStats:
        return dataclasses.replace(
            stats, num_inflight=self.num_inflight, engine_restarts=self.engine_restarts
        )

    def _check_serving(self) -> None:
        if not self._started:
            raise RuntimeError("the engine client is not started; await start() first")
        if not self._accepting:
            raise EngineDeadError("the engine is shutting down; retry on another replica")
        if not self.healthy:
            raise EngineDeadError("the engine is not available (restarting); retry shortly")

    # ---- bookkeeping -----------------------------------------------------------------------

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        """Route one step's outputs to their streams (on the event loop)."""
        for out in outputs:
            stream = self._sample_of.get(out.request_id)
            if stream is None:
                continue  # aborted or failed meanwhile
            index = stream.unfinished[out.request_id]
            if out.finish_reason is not None:
                del stream.unfinished[out.request_id]
                del self._sample_of[out.request_id]
                if not stream.unfinished:
                    self._forget(stream)
            stream.queue.put_nowait(
                RequestDelta(
                    stream.request_id,
                    index,
                    out.new_token_ids,
                    out.new_logprobs,
                    out.finish_reason,
                    out.stop_reason,
                    out.num_cached_tokens,
                    out.queue_time,
                    out.error,
                    out.error_code,
                )
            )

    def _abort_stream(self, stream: _Stream) -> None:
        ids = list(stream.unfinished)
        for sid, index in stream.unfinished.items():
            self._sample_of.pop(sid, None)
            stream.queue.put_nowait(
                RequestDelta(stream.request_id, index, [], None, "abort", None, 0)
            )
        stream.unfinished.clear()
        self._forget(stream)
        if ids:
            self._send_abort(ids)

    def _abort_all(self) -> None:
        for stream in list(self._streams.values()):
            self._abort_stream(stream)

    def _fail_all(self, message: str) -> None:
        """Every in-flight request raises ``EngineDeadError(message)``: the engine lost them."""
        for stream in list(self._streams.values()):
            self._fail_stream(stream, EngineDeadError(message))

    def _fail_stream(self, stream: _Stream, exc: BaseException) -> None:
        for sid in stream.unfinished:
            self._sample_of.pop(sid, None)
        stream.unfinished.clear()
        stream.queue.put_nowait(exc)
        self._forget(stream)

    def _forget(self, stream: _Stream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            self._lora_request_ended(stream.lora_key)
        if not self._streams:
            self._idle.set()

    async def _drain(self, timeout: float) -> None:
        """Stop accepting; wait up to ``timeout`` for in-flight requests, then abort the rest."""
        self._accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            self._abort_all()
