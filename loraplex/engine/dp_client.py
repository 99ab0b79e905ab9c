"""DataParallelClient: N engine replicas behind one ``EngineClient`` (``serve --data-parallel-size``).

    platform ──► DataParallelClient ──► router (dp_router) ──► replica 0 (ProcEngineClient)
                                                          └──► replica 1 ...

Each replica is a whole engine with its own KV cache and adapter pool, in its own supervised
process, pinned to its own share of the CPUs (``replica_placements``; one GPU each on CUDA).

Adapters: this client keeps the platform-facing ``AdapterTable`` (owners, references,
retiring); each replica's own table holds the copies placed on it under one owner,
``DP_OWNER``. ``add_lora`` validates and loads an adapter on one replica (the one holding the
fewest adapters, or the one that already holds that content); a request routed to a replica
that lacks its adapter loads it there first (once, however many requests wait for it). The
last release unloads it from every replica. ``adapter_loads[i]`` counts the loads on replica i
by key.

Failover: a replica that dies fails its in-flight requests with ``EngineDeadError`` at once
(``ProcEngineClient``'s supervision) and is skipped by the router until it is back; requests
not yet handed to a replica (waiting for an adapter load, or routed to a replica that died
meanwhile) are routed again. A request that reached an engine is never re-run elsewhere: one
that crashes its engine must not take the others down too. The restarted replica reloads the
adapters it held; its prefixes are forgotten by the router.

No torch here: the server imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections import Counter
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass

from loraplex.config import EngineConfig
from loraplex.engine.client import (
    AdapterInfo,
    AdapterNotLoadedError,
    EngineClient,
    EngineDeadError,
    EngineInfo,
    EngineStartupError,
    EngineStats,
    RequestDelta,
    StreamingClient,
    check_tenant_weights,
)
from loraplex.engine.dp_router import (
    ROUTING_POLICIES,
    ReplicaView,
    Router,
    RoutingPolicy,
    make_router,
    prefix_chain,
)
from loraplex.engine.dp_stats import StatsCombiner
from loraplex.engine.proc_main import Placement
from loraplex.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DP_OWNER = "data-parallel"  # the owner of every adapter copy in a replica's own table
REPLICA_STATS_TIMEOUT_S = 2.0  # a replica slower than this is left out of one snapshot


@dataclass(frozen=True)
class ReplicaState:
    """One replica, for operators and benchmarks."""

    index: int
    healthy: bool
    inflight: int  # requests routed to it and not finished
    adapters: int  # adapters it holds now
    adapter_loads: int  # adapter loads this client made on it
    engine_restarts: int
    unhealthy_reason: str | None


def usable_cpu_list() -> list[int]:
    """The CPUs this process may run on, in order (its affinity mask)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def replica_placements(
    size: int, device: str = "cpu", tensor_parallel_size: int = 1
) -> list[tuple[Placement, int]]:
    """Each replica's placement and torch thread count: disjoint contiguous shares of this
    process's CPUs (threads: its share of the usable CPUs, a cgroup quota included; a
    tensor-parallel replica's ranks split its share), and on CUDA ``tensor_parallel_size``
    visible GPUs each. ``ValueError`` saying why when ``size`` does not fit."""
    from loraplex.cpu_threads import usable_cpus

    if size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {size}")
    cpus = usable_cpu_list()
    usable = min(usable_cpus(), len(cpus))
    gpus = _cuda_devices(device)
    if gpus is not None:
        if ":" in device and size > 1:
            raise ValueError(
                f"--device {device} names one GPU; with --data-parallel-size {size} use "
                "--device cuda (each replica gets one of the visible GPUs)"
            )
        tp = tensor_parallel_size
        if size * tp > len(gpus):
            raise ValueError(
                f"--data-parallel-size {size} with tensor_parallel_size {tp} needs "
                f"{size * tp} GPUs ({tp} per replica), but {len(gpus)} are visible; lower "
                "them or make more GPUs visible"
            )
        shares = _split(cpus, size) if size <= usable else [[] for _ in range(size)]
        threads = max(1, usable // size)
        return [
            (Placement(tuple(share), ",".join(gpus[i * tp : (i + 1) * tp])), threads)
            for i, share in enumerate(shares)
        ]
    if size > usable:
        raise ValueError(
            f"--data-parallel-size {size} needs at least {size} CPUs (one per replica), but "
            f"this process may use {usable}; lower it to at most {usable}"
        )
    threads = usable // size
    return [(Placement(tuple(share)), threads) for share in _split(cpus, size)]


def _split(cpus: list[int], parts: int) -> list[list[int]]:
    q, r = divmod(len(cpus), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + q + (1 if i < r else 0)
        out.append(cpus[start:end])
        start = end
    return out


def _cuda_devices(device: str) -> list[str] | None:
    """The visible CUDA devices when the engine will run on CUDA, else None."""
    if device == "cpu":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    import torch  # only to count GPUs; the engine processes import it anyway

    if not torch.cuda.is_available():
        if device != "auto":
            raise ValueError(f"device {device!r} was asked for, but CUDA is not available")
        return None
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        return ids[: torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


class DataParallelClient(EngineClient):
    """Routes each request to one of ``replicas`` (all started and stopped with this client).

    Invariants: ``_routes`` holds every request in flight (None while it is being routed);
    ``_inflight[i]`` counts those routed to replica i; an adapter a request uses is held by this
    client's table for the request's whole life, so no replica unloads it under the request.
    """

    def __init__(
        self, replicas: Sequence[StreamingClient], routing: RoutingPolicy = "affinity"
    ) -> None:
        if not replicas:
            raise ValueError("a data-parallel client needs at least one replica")
        self.replicas = list(replicas)
        self.router: Router = make_router(routing)
        self._init_adapters()
        n = len(self.replicas)
        self._inflight = [0] * n
        self._routes: dict[str, int | None] = {}
        self._aborted: set[str] = set()  # aborted while being routed
        self._loading: dict[tuple[int, str], asyncio.Task[AdapterInfo]] = {}
        self._restarts_seen = [0] * n
        self.adapter_loads: list[Counter[str]] = [Counter() for _ in range(n)]
        self._stats = StatsCombiner(n)
        self._started = False
        self._accepting = True
        self._shutdown: asyncio.Task[None] | None = None

    @classmethod
    def of_processes(
        cls,
        config: EngineConfig,
        model_dir: str,
        size: int,
        routing: RoutingPolicy = "affinity",
    ) -> DataParallelClient:
        """``size`` supervised engine processes, each on its own share of the machine."""
        from loraplex.engine.proc_client import ProcEngineClient

        if routing not in ROUTING_POLICIES:
            raise ValueError(f"--dp-routing must be one of {', '.join(ROUTING_POLICIES)}")
        replicas = [
            ProcEngineClient(config, model_dir, num_threads=threads, placement=placement)
            for placement, threads in replica_placements(
                size, config.model.device, config.model.tensor_parallel_size
            )
        ]
        return cls(replicas, routing)

    @property
    def routing(self) -> RoutingPolicy:
        return self.router.policy

    def set_routing(self, policy: RoutingPolicy) -> None:
        """Route new requests by ``policy`` (from a fresh router: no prefixes remembered)."""
        self.router = make_router(policy)

    # ---- life ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(
                *(r.shutdown(timeout=1.0) for r in self.replicas), return_exceptions=True
            )
            raise failed[0]
        self.info = _common_info([r.info for r in self.replicas])
        self._restarts_seen = [r.engine_restarts for r in self.replicas]
        self._started = True

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self._shutdown is None:
            self._accepting = False
            self._shutdown = asyncio.create_task(self._do_shutdown(timeout))
        await asyncio.shield(self._shutdown)

    async def _do_shutdown(self, timeout: float) -> None:
        await asyncio.gather(
            *(r.shutdown(timeout=timeout) for r in self.replicas), return_exceptions=True
        )

    @property
    def healthy(self) -> bool:
        return self._started and self._shutdown is None and any(r.healthy for r in self.replicas)

    @property
    def unhealthy_reason(self) -> str | None:
        if self.healthy:
            return None
        if self._shutdown is not None:
            return "the engine is shut down"
        if not self._started:
            return "the engine is not running"
        reasons = "; ".join(
            f"replica {i}: {r.unhealthy_reason}" for i, r in enumerate(self.replicas)
        )
        return f"no engine replica is serving ({reasons})"

    @property
    def num_inflight(self) -> int:
        return len(self._routes)

    @property
    def engine_restarts(self) -> int:
        return sum(r.engine_restarts for r in self.replicas)

    def replica_states(self) -> list[ReplicaState]:
        return [
            ReplicaState(
                index=i,
                healthy=r.healthy,
                inflight=self._inflight[i],
                adapters=len(r.lora_keys(DP_OWNER)),
                adapter_loads=sum(self.adapter_loads[i].values()),
                engine_restarts=r.engine_restarts,
                unhealthy_reason=r.unhealthy_reason,
            )
            for i, r in enumerate(self.replicas)
        ]

    # ---- requests --------------------------------------------------------------------------

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
        # The replica checks these again; done here so that bad input fails at the call.
        self._checked_requests(
            request_id, prompt_token_ids, params, self._routes, lora_key=lora_key,
            cache_extra_keys=cache_extra_keys, tenant=tenant, priority=priority,
        )  # fmt: skip
        request = _Routed(
            request_id, list(prompt_token_ids), params, lora_key, cache_extra_keys, tenant,
            priority,
        )  # fmt: skip
        return self._run(request)

    async def _run(self, req: _Routed) -> AsyncGenerator[RequestDelta, None]:
        # Routed on first iteration, like the replicas submit: an unused iterator leaks nothing.
        self._check_serving()
        if req.request_id in self._routes:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self._check_lora(req.lora_key)
        self._routes[req.request_id] = None
        self._lora_request_started(req.lora_key)
        index: int | None = None
        stream: AsyncGenerator[RequestDelta, None] | None = None
        try:
            index, stream = await self._submit(req)
            if stream is None:  # aborted while its adapter loaded
                for k in range(req.params.n):
                    yield RequestDelta(req.request_id, k, [], None, "abort", None, 0)
                return
            async for delta in stream:
                yield delta
        finally:
            if stream is not None:
                await stream.aclose()  # aborts it in the replica if unfinished
            if index is not None:
                self._inflight[index] -= 1
            self._routes.pop(req.request_id, None)
            self._aborted.discard(req.request_id)
            self._lora_request_ended(req.lora_key)

    async def _submit(
        self, req: _Routed
    ) -> tuple[int | None, AsyncGenerator[RequestDelta, None] | None]:
        """Route ``req`` and start it on a replica; a replica found dead before the request
        reached it is skipped and the request routed again."""
        prefix = prefix_chain(
            req.prompt_token_ids, self.info.block_size, req.lora_key, req.cache_extra_keys
        )
        skipped: set[int] = set()
        while True:
            index = self.router.choose(self._views(req.lora_key, skipped), prefix)
            if index is None:
                raise EngineDeadError(
                    "no engine replica is available (all are restarting); retry shortly"
                )
            replica = self.replicas[index]
            self._inflight[index] += 1
            try:
                if req.lora_key is not None:
                    await self._ensure_adapter(index, req.lora_key)
                if req.request_id in self._aborted:
                    self._inflight[index] -= 1
                    return None, None
                # No await from here until the replica sends it (first iteration, below).
                stream = replica.generate(
                    req.request_id,
                    req.prompt_token_ids,
                    req.params,
                    lora_key=req.lora_key,
                    cache_extra_keys=req.cache_extra_keys,
                    tenant=req.tenant,
                    priority=req.priority,
                )
            except EngineDeadError:
                self._inflight[index] -= 1
                skipped.add(index)
                continue
            except BaseException:
                self._inflight[index] -= 1
                raise
            self._routes[req.request_id] = index
            self.router.served(index, prefix)
            return index, stream

    def _views(self, lora_key: str | None, skipped: set[int]) -> list[ReplicaView]:
        views = []
        for i, r in enumerate(self.replicas):
            if r.engine_restarts != self._restarts_seen[i]:  # a new process: empty KV cache
                self._restarts_seen[i] = r.engine_restarts
                self.router.forget_replica(i)
            has = lora_key is None or r.has_lora(lora_key) or (i, lora_key) in self._loading
            views.append(ReplicaView(i, r.healthy and i not in skipped, self._inflight[i], has))
        return views

    async def abort(self, request_id: str) -> None:
        if request_id not in self._routes:
            return
        index = self._routes[request_id]
        if index is None:
            self._aborted.add(request_id)  # still being routed: it ends with "abort"
        else:
            await self.replicas[index].abort(request_id)

    def _check_serving(self) -> None:
        if not self._started:
            raise RuntimeError("the engine client is not started; await start() first")
        if not self._accepting:
            raise EngineDeadError("the engine is shutting down; retry on another replica")
        if not self.healthy:
            raise EngineDeadError("no engine replica is available (restarting); retry shortly")

    # ---- adapters --------------------------------------------------------------------------

    async def _ensure_adapter(self, index: int, key: str) -> None:
        """Replica ``index`` holds ``key`` once this returns (one load however many wait)."""
        if self.replicas[index].has_lora(key):
            return
        task = self._loading.get((index, key))
        if task is None:
            held = self._loras.get(key)
            if held is None or not held.paths:  # retiring: its owners' files may be gone
                raise AdapterNotLoadedError(
                    f"adapter {key[:12]} was removed while this request waited; add it again"
                )
            task = asyncio.create_task(
                self._load_on(index, held.name, held.source, held.pinned, expect=key)
            )
            self._loading[(index, key)] = task
            task.add_done_callback(lambda done: self._loading_done(index, key, done))
        await asyncio.shield(task)  # a cancelled request leaves the load to finish

    def _loading_done(self, index: int, key: str, task: asyncio.Task[AdapterInfo]) -> None:
        if self._loading.get((index, key)) is task:
            del self._loading[(index, key)]
        if not task.cancelled():
            task.exception()  # retrieved: its waiters saw it

    async def _load_on(
        self, index: int, name: str, path: str, pinned: bool, expect: str | None = None
    ) -> AdapterInfo:
        replica = self.replicas[index]
        info = await replica.add_lora(name, path, pinned, owner=DP_OWNER)
        self.adapter_loads[index][info.key] += 1
        if expect is not None and info.key != expect:
            if not self._loras.usable(info.key):
                await replica.release_lora(info.key, owner=DP_OWNER)
            raise AdapterNotLoadedError(
                f"adapter {name!r}: its files at {path} changed since it was added; add it again"
            )
        return info

    async def _load_lora(self, name: str, path: str, pinned: bool) -> AdapterInfo:
        # The content this path already holds (a re-add, or the repoint of a release) stays
        # where it is; new content goes to the replica holding the fewest adapters.
        known = {h.info.key for h in self._loras.held() if path in h.paths.values()}
        healthy = [i for i, r in enumerate(self.replicas) if r.healthy]
        order = sorted(
            healthy,
            key=lambda i: (
                not any(self.replicas[i].has_lora(k) for k in known),
                len(self.replicas[i].lora_keys(DP_OWNER)),
                self._inflight[i],
                i,
            ),
        )
        dead = EngineDeadError("no engine replica is available (restarting); retry shortly")
        for i in order:
            try:
                info = await self._load_on(i, name, path, pinned)
            except EngineDeadError as exc:
                dead = exc
                continue
            for j, other in enumerate(self.replicas):  # every copy reads the newest source
                if j != i and other.has_lora(info.key):
                    with contextlib.suppress(EngineDeadError):
                        await self._load_on(j, name, path, pinned)
            return info
        raise dead

    async def retry_lora(self, key: str) -> bool:
        retried = False
        for replica in self.replicas:
            if replica.healthy and replica.has_lora(key):
                with contextlib.suppress(EngineDeadError):
                    retried = await replica.retry_lora(key) or retried
        return retried

    async def _unload_lora(self, key: str) -> None:
        pending = [t for (_, k), t in self._loading.items() if k == key]
        await asyncio.gather(*pending, return_exceptions=True)
        for replica in self.replicas:
            if replica.has_lora(key):
                # A dead replica forgets it; a busy one removes it when its requests end.
                await replica.release_lora(key, owner=DP_OWNER)

    # ---- stats, weights --------------------------------------------------------------------

    async def stats(self) -> EngineStats:
        if not self._started:
            raise RuntimeError("the engine client is not started; await start() first")

        async def one(replica: StreamingClient) -> EngineStats | None:
            if not replica.healthy:
                return None
            try:
                return await asyncio.wait_for(replica.stats(), REPLICA_STATS_TIMEOUT_S)
            except (EngineDeadError, asyncio.TimeoutError):
                return None

        snapshots = await asyncio.gather(*(one(r) for r in self.replicas))
        if all(s is None for s in snapshots):
            raise EngineDeadError("no engine replica answered (restarting); retry shortly")
        keys = [held.info.key for held in self._loras.held()]
        return self._stats.combine(snapshots, keys, num_inflight=self.num_inflight)

    async def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        checked = check_tenant_weights(weights)
        await asyncio.gather(*(r.set_tenant_weights(checked) for r in self.replicas))


@dataclass(frozen=True)
class _Routed:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_key: str | None
    cache_extra_keys: tuple[str, ...]
    tenant: str | None
    priority: int


def _common_info(infos: list[EngineInfo]) -> EngineInfo:
    """The replicas' ``EngineInfo``: they run one config, so they must agree (the KV size may
    differ where device memory does: the smallest is what every replica accepts)."""
    smallest = min(info.num_blocks for info in infos)
    first = dataclasses.replace(infos[0], num_blocks=smallest)
    for i, info in enumerate(infos[1:], 1):
        if dataclasses.replace(info, num_blocks=smallest) != first:
            raise EngineStartupError(
                f"data-parallel replica {i} reports {info}, replica 0 {infos[0]}: they must "
                "serve the same model with the same limits"
            )
    return first
