"""The child-process client's supervision: kill -9 under load fails every in-flight request with
EngineDeadError at once, the engine restarts with its adapters (same keys) and the tenant weights
last given (also while it was down) and serves again; a bad model directory is a clean startup
error, not a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from loraplex import SamplingParams
from loraplex.engine.client import EngineDeadError, EngineStartupError, RequestDelta
from loraplex.engine.proc_client import ProcEngineClient
from tests.utils.clients import (
    collect,
    engine_config,
    sample_tokens,
    start_client,
    stop_client,
)
from tests.utils.models import make_adapter, make_tiny_model


def test_kill_9_under_load_fails_inflight_then_restarts_with_adapters(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=6)
    adapter_dir = make_adapter(model_dir, tmp_path / "a", 4, 8, ["q_proj", "v_proj"], seed=1)
    served = start_client("proc", engine_config(model_dir), model_dir)
    client = served.client
    assert isinstance(client, ProcEngineClient)
    try:
        lora = served.run(client.add_lora("a4", adapter_dir, pinned=True))
        served.run(client.set_tenant_weights({"t": 3.0}))
        prompt = [9, 10, 11, 12, 13]
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        before = served.run(collect(client.generate("pre", prompt, greedy, lora_key=lora.key)))
        long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

        async def drain(stream: object) -> list[RequestDelta]:
            return await collect(stream)

        async def kill_under_load() -> tuple[float, float, int]:
            loop = asyncio.get_running_loop()
            streams = [
                client.generate(f"k{i}", [5 + i, 6, 7], long, lora_key=lora.key if i % 2 else None)
                for i in range(6)
            ]
            for stream in streams:  # every request is running in the engine
                await stream.__anext__()
            old_pid = client.pid
            assert old_pid is not None
            killed_at = loop.time()
            os.kill(old_pid, signal.SIGKILL)
            results = await asyncio.gather(*(drain(s) for s in streams), return_exceptions=True)
            latency = loop.time() - killed_at
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert not client.healthy
            with pytest.raises(EngineDeadError):
                client.generate("during", prompt, greedy)
            with pytest.raises(EngineDeadError):
                await client.stats()
            await client.set_tenant_weights({"t": 3.0, "u": 0.5})  # kept for the new engine
            while not client.healthy:
                assert loop.time() - killed_at < 90, "the engine did not come back"
                await asyncio.sleep(0.02)
            return latency, loop.time() - killed_at, old_pid

        latency, restart, old_pid = served.run(kill_under_load(), timeout=120)
        print(f"\nkill -9 -> EngineDeadError in every stream: {latency * 1000:.1f} ms; "
              f"kill -> healthy again: {restart:.2f} s")  # fmt: skip
        assert latency < 5
        assert client.pid != old_pid and client.engine_restarts == 1

        stats = served.run(client.stats())
        assert stats.engine_restarts == 1 and stats.num_inflight == 0
        assert {t: s.weight for t, s in stats.tenants.items()} == {"t": 3.0, "u": 0.5}
        assert stats.lora.registered == 1 and stats.kv_blocks_used == 0
        after = served.run(collect(client.generate("post", prompt, greedy, lora_key=lora.key)))
        assert sample_tokens(after) == sample_tokens(before)  # same adapter, same key
        again = served.run(client.add_lora("a4", adapter_dir))
        assert again.key == lora.key
    finally:
        stop_client(served)
    assert client.process is not None and client.process.exitcode == 0


def test_bad_model_dir_is_a_clean_startup_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    client = ProcEngineClient(engine_config(missing), missing)
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match="no-such-model") as err:
        asyncio.run(client.start())
    assert time.monotonic() - start < 60
    assert "could not start the engine" in str(err.value)
    assert not client.healthy
    assert client.process is not None and not client.process.is_alive()
    assert client.process.exitcode == 1
