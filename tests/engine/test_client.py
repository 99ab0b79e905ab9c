"""The EngineClient contract, for both clients (in-process and child-process): same tokens as
``LLM.generate`` under concurrency, n > 1, logprobs, abort / consumer close free every KV block,
adapters (and AdapterError) through the client, bad input, shutdown while requests run, tenant
weights and per-tenant stats.

One client per kind serves the whole module: it lives on an event loop in a background thread
(``Harness.run``), so the child process starts once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.client import NO_TENANT, EngineDeadError, RequestDelta, TenantStats
from loraplex.engine.proc_client import ProcEngineClient
from loraplex.engine.request import Request
from loraplex.llm import LLM
from loraplex.lora.adapter import AdapterError
from tests.utils.clients import (
    ENGINE,
    Harness,
    Served,
    collect,
    engine_config,
    finishes,
    make_client,
    sample_tokens,
    sample_trace,
    start_client,
    stop_client,
)
from tests.utils.models import make_adapter, make_tiny_model
from tests.utils.reference import TOP, assert_close, traces


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("client") / "m", "llama", seed=5)


@pytest.fixture(scope="module")
def adapter_dir(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("client-lora") / "a8"
    return make_adapter(model_dir, out, 8, 16, ["q_proj", "v_proj", "down_proj"], seed=3)


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, **ENGINE)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["inproc", "proc"])
def served(request: pytest.FixtureRequest, model_dir: str) -> Iterator[Served]:
    s = start_client(request.param, engine_config(model_dir), model_dir)
    yield s
    stop_client(s)


def assert_engine_idle(served: Served) -> None:
    stats = served.run(served.client.stats())
    assert stats.kv_blocks_used == 0, stats
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert stats.num_inflight == 0, stats


def workload(seed: int, n: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    return prompts, [rng.randint(1, 24) for _ in range(n)]


def test_concurrent_greedy_with_logprobs_matches_llm(served: Served, llm: LLM) -> None:
    prompts, max_tokens = workload(seed=1, n=10)
    params = [SamplingParams(max_tokens=m, temperature=0.0, logprobs=TOP) for m in max_tokens]
    ref = llm.generate(prompts, params, use_tqdm=False)

    async def go() -> list[list[RequestDelta]]:
        streams = [
            collect(served.client.generate(f"g{i}", p, sp))
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        return list(await asyncio.gather(*streams))

    results = served.run(go())
    ours = [sample_trace(deltas) for deltas in results]
    assert assert_close(ours, traces(ref)) <= 1
    for deltas, r in zip(results, ref, strict=True):
        assert {d.request_id for d in deltas} == {deltas[0].request_id}
        assert finishes(deltas) == {0: r.outputs[0].finish_reason}
        lps = r.outputs[0].logprobs
        assert lps is not None
        for (tok, top), ref_lp in zip(zip(*sample_trace(deltas), strict=True), lps, strict=False):
            if tok in ref_lp:
                assert top[tok] == pytest.approx(ref_lp[tok].logprob, abs=1e-3)
    assert_engine_idle(served)


def test_n2_seeded_samples_match_llm(served: Served, llm: LLM) -> None:
    prompt = [7, 8, 9, 10, 11, 12, 13]
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)
    ref = llm.generate([prompt], params, use_tqdm=False)[0]

    async def go() -> tuple[list[RequestDelta], list[RequestDelta]]:
        other = collect(served.client.generate("n1", [5, 6], SamplingParams(max_tokens=5)))
        return await asyncio.gather(collect(served.client.generate("n2", prompt, params)), other)

    deltas, _ = served.run(go())
    assert finishes(deltas) == {0: "length", 1: "length"}
    assert sample_tokens(deltas, 0) == ref.outputs[0].token_ids
    assert sample_tokens(deltas, 1) == ref.outputs[1].token_ids
    assert sample_tokens(deltas, 0) != sample_tokens(deltas, 1)
    assert_engine_idle(served)


LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


def test_abort_mid_stream_frees_every_block(served: Served) -> None:
    client = served.client

    async def go() -> list[RequestDelta]:
        stream = client.generate(
            "ab",
            list(range(3, 40)),
            SamplingParams(n=2, max_tokens=100, temperature=0.0, ignore_eos=True),
        )
        seen: list[RequestDelta] = []
        async for delta in stream:
            seen.append(delta)
            if len(seen) == 3:
                await client.abort("ab")
                # The blocks are free before any later call is served.
                stats = await client.stats()
                assert stats.kv_blocks_used == 0 and stats.num_running == 0, stats
        return seen

    seen = served.run(go())
    assert finishes(seen) == {0: "abort", 1: "abort"}
    assert len(sample_tokens(seen, 0)) < 100
    served.run(client.abort("no-such-request"))  # unknown ids are ignored
    assert_engine_idle(served)


def test_consumer_close_or_cancel_aborts(served: Served) -> None:
    client = served.client

    async def close_early() -> None:
        stream = client.generate("cl", [5, 6, 7], LONG)
        n = 0
        async for _ in stream:
            n += 1
            if n == 2:
                break
        await stream.aclose()
        stats = await client.stats()
        assert stats.kv_blocks_used == 0 and stats.num_inflight == 0, stats

    async def cancel_consumer() -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in client.generate("cc", [5, 6, 8], LONG):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await client.stats()
        assert stats.kv_blocks_used == 0 and stats.num_inflight == 0, stats

    served.run(close_early())
    served.run(cancel_consumer())
    assert_engine_idle(served)


def test_adapters_through_the_client(
    served: Served, llm: LLM, adapter_dir: str, tmp_path: Path
) -> None:
    client = served.client
    prompt = [9, 10, 11, 12, 13]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.add_lora(LoRARequest("a8", adapter_dir))
    ref = llm.generate(
        [prompt], params, lora_request=LoRARequest("a8", adapter_dir), use_tqdm=False
    )

    info = served.run(client.add_lora("a8", adapter_dir))
    assert (info.name, info.rank, len(info.key)) == ("a8", 8, 64)
    assert set(info.target_modules) == {"q_proj", "v_proj", "down_proj"} and info.size_bytes > 0
    deltas = served.run(collect(client.generate("la", prompt, params, lora_key=info.key)))
    base = served.run(collect(client.generate("lb", prompt, params)))
    assert sample_tokens(deltas) == ref[0].outputs[0].token_ids
    assert sample_tokens(deltas) != sample_tokens(base)

    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError) as err:
        served.run(client.add_lora("bad", str(tmp_path / "empty")))
    assert err.value.code == "missing_file", err.value

    async def remove_while_in_use() -> None:
        stream = client.generate("lu", prompt, LONG, lora_key=info.key)
        await stream.__anext__()
        with pytest.raises(ValueError, match="in use"):
            await client.remove_lora(info.key)
        await stream.aclose()

    served.run(remove_while_in_use())
    served.run(client.remove_lora(info.key))
    with pytest.raises(ValueError, match="not loaded"):
        client.generate("lc", prompt, params, lora_key=info.key)
    assert served.run(client.stats()).lora.registered == 0
    assert_engine_idle(served)


def test_adapter_references_across_owners(served: Served, adapter_dir: str, tmp_path: Path) -> None:
    """One engine copy per content, counted by owner: a release leaves it for the others, and
    the last release waits for the requests still running on it (new ones are refused)."""
    client = served.client
    prompt = [9, 10, 11, 12, 13]
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    copy = tmp_path / "copy"  # the same content at another path: the registry's own files
    copy.mkdir()
    for f in Path(adapter_dir).iterdir():
        (copy / f.name).write_bytes(f.read_bytes())

    op = served.run(client.add_lora("a8", adapter_dir))
    reg = served.run(client.add_lora("t/a8@1", str(copy), owner="registry"))
    assert reg.key == op.key and client.lora_owners(op.key) == {"operator", "registry"}
    assert served.run(client.stats()).lora.registered == 1  # one engine copy

    served.run(client.remove_lora(op.key))  # the operator's unload: the registry keeps it
    assert client.has_lora(op.key) and client.lora_owners(op.key) == {"registry"}
    assert served.run(collect(client.generate("r1", prompt, short, lora_key=op.key)))

    async def release_while_running() -> tuple[bool, bool]:
        stream = client.generate("r2", prompt, LONG, lora_key=op.key)
        await stream.__anext__()
        release = await client.release_lora(op.key, owner="registry")
        waiting = not release.removed.done()
        with pytest.raises(ValueError, match="not loaded"):  # retiring: no new requests
            client.generate("r3", prompt, short, lora_key=op.key)
        await stream.aclose()  # the last request on it ends: now it goes
        return waiting, await asyncio.wait_for(release.removed, 10)

    assert served.run(release_while_running()) == (True, True)
    assert not client.has_lora(op.key)
    assert served.run(client.stats()).lora.registered == 0
    assert client.retain_lora(op.key, "registry", str(copy)) is False  # gone: add it again
    again = served.run(client.add_lora("t/a8@2", str(copy), owner="registry"))
    assert again.key == op.key and client.has_lora(op.key)
    served.run(client.release_lora(op.key, owner="registry"))
    assert served.run(client.stats()).lora.registered == 0
    assert_engine_idle(served)


@pytest.mark.parametrize(
    ("prompt", "field"),
    [([], "prompt"), ([5, 512], "prompt_token_ids"), ([5, -1], "prompt_token_ids"),
     (list(range(3, 200)), "max_model_len")],
)  # fmt: skip
def test_bad_input_raises_at_the_call(served: Served, prompt: list[int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        served.client.generate("bad", prompt, SamplingParams())


def test_tenant_and_priority_reach_the_engine_requests(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = served.client
    sent: list[Request] = []
    send = client._send_requests  # type: ignore[attr-defined]

    def record(requests: list[Request]) -> None:
        sent.extend(requests)
        send(requests)

    monkeypatch.setattr(client, "_send_requests", record)
    params = SamplingParams(max_tokens=2, n=2, seed=1)
    deltas = served.run(collect(client.generate("tp", [5, 6], params, tenant="t1", priority=4)))
    assert set(finishes(deltas)) == {0, 1}
    assert [(r.tenant, r.priority) for r in sent] == [("t1", 4), ("t1", 4)]
    assert_engine_idle(served)


def test_duplicate_request_id_is_refused(served: Served) -> None:
    client = served.client

    async def go() -> None:
        stream = client.generate("dup", [5, 6], LONG)
        await stream.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            client.generate("dup", [5, 6], LONG)
        await stream.aclose()

    served.run(go())
    assert served.client.healthy
    assert_engine_idle(served)


@pytest.mark.parametrize("kind", ["inproc", "proc"])
def test_shutdown_lets_short_requests_finish_and_aborts_the_rest(kind: str, model_dir: str) -> None:
    # A long context so that the long requests cannot finish within the shutdown timeout: 500
    # decode steps of this tiny model take several times the timeout on any machine.
    config = engine_config(model_dir, max_model_len=512, num_blocks=600)
    served = start_client(kind, config, model_dir)
    client = served.client
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def go() -> tuple[list[list[RequestDelta]], float]:
        loop = asyncio.get_running_loop()
        short = asyncio.create_task(
            collect(client.generate("s", [5], SamplingParams(max_tokens=2)))
        )
        longs = [
            asyncio.create_task(collect(client.generate(f"l{i}", [6, i], long))) for i in range(3)
        ]
        await asyncio.sleep(0.05)  # all four submitted
        start = loop.time()
        await client.shutdown(timeout=0.1)
        elapsed = loop.time() - start
        await client.shutdown()  # idempotent
        with pytest.raises(EngineDeadError):
            client.generate("late", [5], SamplingParams())
        return [short.result(), *await asyncio.gather(*longs)], elapsed

    try:
        results, elapsed = served.run(go())
    finally:
        served.harness.close()
    assert finishes(results[0]) == {0: "length"}
    for deltas in results[1:]:
        assert finishes(deltas) == {0: "abort"}
        assert 0 < len(sample_tokens(deltas)) < 500
    assert elapsed < 10
    assert not client.healthy
    if isinstance(client, ProcEngineClient):
        assert client.process is not None and client.process.exitcode == 0


@pytest.mark.parametrize("kind", ["inproc", "proc"])
def test_tenant_weights_and_tenant_stats_through_the_client(kind: str, model_dir: str) -> None:
    """Weights given before start reach the engine; a bad weight is refused at the call and
    keeps the weights before it; stats report each tenant's service and weight."""
    harness = Harness()
    client = make_client(kind, engine_config(model_dir, scheduling_policy="fair"), model_dir)
    served = Served(kind, client, harness)
    try:
        served.run(client.set_tenant_weights({"a": 2.0}))
        served.run(client.start())
        stats = served.run(client.stats())
        assert stats.tenants["a"] == TenantStats(virtual_service=0.0, weight=2.0)
        with pytest.raises(ValueError, match="weight of tenant 'b'"):
            served.run(client.set_tenant_weights({"a": 1.0, "b": -1.0}))
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        deltas = served.run(collect(client.generate("wa", [5, 6, 7, 8, 9], params, tenant="a")))
        assert len(sample_tokens(deltas)) == 4
        a = served.run(client.stats()).tenants["a"]
        assert (a.num_prompt_tokens_computed, a.num_generated_tokens) == (5, 4)
        assert a.virtual_service == (5 + 2 * 4) / 2.0  # the weight before the refused call
        served.run(client.set_tenant_weights({"b": 4.0}))
        served.run(collect(client.generate("wo", [9, 8, 7], params)))
        tenants = served.run(client.stats()).tenants
        assert (tenants["a"].weight, tenants["b"].weight, tenants[NO_TENANT].weight) == (1, 4, 1)
        assert tenants[NO_TENANT].num_generated_tokens == 4
        assert_engine_idle(served)
    finally:
        stop_client(served)
