"""Speculative decoding in the engine process: the config crosses to the child, its counters come
back in ``stats()``, and after a ``kill -9`` the restarted engine speculates again (its counters
from zero) with the same greedy output."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path

from loraplex import SamplingParams
from loraplex.config import SpeculativeConfig
from loraplex.engine.proc_client import ProcEngineClient
from tests.utils.clients import collect, engine_config, sample_tokens, start_client, stop_client
from tests.utils.models import make_tiny_model


def test_the_engine_process_speculates_before_and_after_a_restart(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=3)
    spec = SpeculativeConfig("ngram", 4, disable_by_batch_size=64)
    config = dataclasses.replace(engine_config(model_dir), speculative_config=spec)
    served = start_client("proc", config, model_dir)
    client = served.client
    assert isinstance(client, ProcEngineClient)
    try:
        prompt = [7, 8, 9, 10, 11, 12] * 4
        greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        before = sample_tokens(served.run(collect(client.generate("a", prompt, greedy))))
        stats = served.run(client.stats())
        assert stats.speculative is not None and stats.speculative.method == "ngram"
        drafted = stats.speculative.num_draft_tokens
        assert drafted > 0

        async def kill_and_wait() -> None:
            assert client.pid is not None
            os.kill(client.pid, signal.SIGKILL)
            loop = asyncio.get_running_loop()
            start = loop.time()
            while not (client.healthy and client.engine_restarts == 1):
                assert loop.time() - start < 90, "the engine did not come back"
                await asyncio.sleep(0.02)

        served.run(kill_and_wait(), timeout=120)
        fresh = served.run(client.stats())
        assert fresh.speculative is not None and fresh.speculative.num_draft_tokens == 0
        after = sample_tokens(served.run(collect(client.generate("b", prompt, greedy))))
        assert after == before
        again = served.run(client.stats())
        assert again.speculative is not None
        assert again.speculative.num_draft_tokens == drafted  # the same steps, the same drafts
    finally:
        stop_client(served)
