"""Running an EngineClient (in-process or child-process) from synchronous tests: ``start_client``
puts it on an event loop in a background thread (``Harness``), ``Served.run`` awaits a call there;
helpers read the deltas a stream yields."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from loraplex.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.engine.client import EngineClient, RequestDelta
from loraplex.engine.inproc_client import InprocEngineClient
from loraplex.engine.proc_client import ProcEngineClient
from tests.utils.reference import Trace

T = TypeVar("T")
ENGINE = dict(max_model_len=128, block_size=4, num_blocks=200)


def engine_config(model_dir: str, **overrides: Any) -> EngineConfig:
    """``ENGINE``'s small engine; ``scheduling_policy`` may be given too."""
    kw = {**ENGINE, **overrides}
    return EngineConfig(
        model=ModelConfig(model=model_dir, max_model_len=kw["max_model_len"]),
        cache=CacheConfig(block_size=kw["block_size"], num_blocks=kw["num_blocks"]),
        scheduler=SchedulerConfig(scheduling_policy=kw.get("scheduling_policy", "fcfs")),
    )


def make_client(kind: str, config: EngineConfig, model_dir: str) -> EngineClient:
    if kind == "proc":
        return ProcEngineClient(config, model_dir)
    return InprocEngineClient(config, model_dir)


class Harness:
    """An event loop in a daemon thread; ``run`` executes a coroutine on it and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float = 60.0) -> T:
        async def wrap() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class Served:
    kind: str
    client: EngineClient
    harness: Harness

    def run(self, coro: Awaitable[T], timeout: float = 60.0) -> T:
        return self.harness.run(coro, timeout)


def start_client(kind: str, config: EngineConfig, model_dir: str) -> Served:
    harness = Harness()
    client = make_client(kind, config, model_dir)
    harness.run(client.start())
    return Served(kind, client, harness)


def stop_client(served: Served) -> None:
    try:
        served.run(served.client.shutdown(timeout=1.0))
    finally:
        served.harness.close()


async def collect(stream: Any) -> list[RequestDelta]:
    return [delta async for delta in stream]


def sample_tokens(deltas: list[RequestDelta], index: int = 0) -> list[int]:
    return [t for d in deltas if d.index == index for t in d.new_token_ids]


def sample_trace(deltas: list[RequestDelta], index: int = 0) -> Trace:
    tops = []
    for d in deltas:
        if d.index == index:
            assert d.new_logprobs is not None
            tops += [{t: v for t, v in lp.top} | {lp.token_id: lp.logprob} for lp in d.new_logprobs]
    return sample_tokens(deltas, index), tops


def finishes(deltas: list[RequestDelta]) -> dict[int, str]:
    done: dict[int, str] = {}
    for d in deltas:
        if d.finish_reason is not None:
            assert d.index not in done, f"sample {d.index} finished twice"
            done[d.index] = d.finish_reason
    return done
