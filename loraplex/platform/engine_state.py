"""The engine's state, as the platform reads it: one helper, one timeout, one way to say why the
engine did not answer. ``/health``, ``/admin/api/engine``, ``/metrics`` and the admin UI all
read ``EngineStats`` through ``read_engine_stats``."""

from __future__ import annotations

import asyncio

from loraplex.engine.client import EngineClient, EngineStats

ENGINE_STATS_TIMEOUT_S = 5.0


class EngineNotAnswering(Exception):
    """The engine is down, hung, or failed to answer; ``reason`` says which (for people)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def read_engine_stats(client: EngineClient, timeout: float | None = None) -> EngineStats:
    """The engine's snapshot within ``timeout`` seconds (default ``ENGINE_STATS_TIMEOUT_S``);
    ``EngineNotAnswering`` otherwise."""
    timeout = ENGINE_STATS_TIMEOUT_S if timeout is None else timeout
    if not client.healthy:
        raise EngineNotAnswering(client.unhealthy_reason or "the engine is not running")
    try:
        return await asyncio.wait_for(client.stats(), timeout)
    except asyncio.TimeoutError:
        raise EngineNotAnswering(f"the engine did not answer within {timeout:g} s") from None
    except Exception as exc:  # a dead engine is exactly what callers report
        raise EngineNotAnswering(f"{type(exc).__name__}: {exc}"[:200]) from None
