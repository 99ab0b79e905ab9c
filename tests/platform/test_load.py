"""Load: 64 concurrent streaming clients over the base model and 3 adapters, through a real
uvicorn server and the engine in its own process (``ProcEngineClient``, as ``serve`` runs it); a
quarter of the clients leave mid-stream.

Every finished stream is complete and equals the same request made alone and non-streamed
(greedy); every stream whose client left is aborted in the engine; afterwards the engine runs
nothing and holds no KV block (cached prefix blocks are free, reusable blocks, so
``kv_blocks_used`` is exactly 0). Requests/s and time-to-first-token percentiles are printed as a
``LOAD-TEST:`` line and written to ``load.json`` in the test's tmp dir.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from loraplex.engine.proc_client import ProcEngineClient
from loraplex.platform.settings import load_settings
from loraplex.server import create_app
from tests.utils.app import add_chat_template
from tests.utils.models import make_adapter, make_tiny_model
from tests.utils.server import ServerThread

NUM_CLIENTS = 64
NUM_LEAVING = NUM_CLIENTS // 4
MAX_TOKENS = 16  # finished streams
LEAVER_MAX_TOKENS = 400  # streams whose client leaves: far from done when it leaves
LEAVE_AFTER_CHUNKS = 3
MODELS = ("tiny", "a1", "a2", "a3")
ADAPTERS = {"a1": (4, 8, ["q_proj", "v_proj"]), "a2": (8, 16, ["q_proj", "k_proj", "v_proj",
            "o_proj"]), "a3": (2, 4, ["gate_proj", "up_proj", "down_proj"])}  # fmt: skip


class RecordingProcClient(ProcEngineClient):
    """Records every engine-core request id it aborts (read from the test thread)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aborted_ids: list[str] = []

    def _send_abort(self, sample_ids: list[str]) -> None:
        self.aborted_ids.extend(sample_ids)
        super()._send_abort(sample_ids)


@dataclass(frozen=True)
class Spec:
    """One request: ``kind`` is "completion" or "chat"; ``words`` the prompt's text."""

    kind: str
    model: str
    words: str

    def body(self, max_tokens: int, stream: bool) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": self.words}]
            return "/v1/chat/completions", body
        body["prompt"] = self.words
        return "/v1/completions", body


@dataclass
class Outcome:
    spec: Spec
    leaves: bool
    request_id: str = ""
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    ttft: float | None = None  # seconds to the first chunk carrying text
    errors: list[Any] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Any]]:
    root = tmp_path_factory.mktemp("load")
    model_dir = make_tiny_model(root / "tiny", "llama", seed=5)
    add_chat_template(model_dir)
    adapter_dirs = {
        name: make_adapter(model_dir, root / name, r, a, targets, seed=i)
        for i, (name, (r, a, targets)) in enumerate(ADAPTERS.items())
    }
    config = EngineConfig(
        model=ModelConfig(model=model_dir, max_model_len=512),
        cache=CacheConfig(block_size=16, num_blocks=1024),
        lora=LoRAConfig(max_loras=4, max_lora_rank=8),
    )
    client = RecordingProcClient(config, model_dir, num_threads=1)
    app = create_app(client, load_settings(served_model_name="tiny"), own_client=True)

    @app.get("/test/engine-stats", include_in_schema=False)
    async def engine_stats() -> dict[str, Any]:
        return dataclasses.asdict(await client.stats())

    with ServerThread(app) as server:
        for name, path in adapter_dirs.items():
            r = httpx.post(
                f"{server.url}/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": path, "pinned": True},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        yield server, client


def _specs() -> list[tuple[Spec, bool]]:
    """64 requests: 4 prompts per model (half completions, half chat), each sent 4 times;
    16 of the 64, spread over every model, leave mid-stream."""
    rng = random.Random(7)
    # 20-40 tokens: the prompts fill whole blocks, so repeats hit the prefix cache
    prompts = [
        " ".join(f"t{rng.randrange(3, 512)}" for _ in range(rng.randint(20, 40))) for _ in range(4)
    ]
    distinct = [
        Spec("chat" if p % 2 else "completion", model, prompts[p])
        for model in MODELS
        for p in range(4)
    ]
    specs = [distinct[i % len(distinct)] for i in range(NUM_CLIENTS)]
    # one leaver per (model, prompt kind) pair and round: every model and both endpoints leave
    leaving = {i for i in range(NUM_CLIENTS) if (i // 16 + i) % 4 == 0}
    assert len(leaving) == NUM_LEAVING
    return [(spec, i in leaving) for i, spec in enumerate(specs)]


def _text_of(event: dict[str, Any]) -> str:
    text = ""
    for choice in event.get("choices", ()):
        if "delta" in choice:
            text += choice["delta"].get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def _stream(http: httpx.AsyncClient, outcome: Outcome) -> None:
    max_tokens = LEAVER_MAX_TOKENS if outcome.leaves else MAX_TOKENS
    path, body = outcome.spec.body(max_tokens, stream=True)
    start = time.perf_counter()
    chunks = 0
    async with http.stream("POST", path, json=body) as r:
        outcome.status = r.status_code
        outcome.request_id = r.headers.get("x-request-id", "")
        if r.status_code != 200:
            outcome.errors.append((await r.aread()).decode())
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                outcome.done = True
                break
            event = json.loads(data)
            if "error" in event:
                outcome.errors.append(event["error"])
                continue
            text = _text_of(event)
            if text:
                chunks += 1
                if outcome.ttft is None:
                    outcome.ttft = time.perf_counter() - start
            outcome.text += text
            for choice in event.get("choices", ()):
                outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
            if event.get("usage"):
                outcome.completion_tokens = event["usage"]["completion_tokens"]
            if outcome.leaves and chunks >= LEAVE_AFTER_CHUNKS:
                break  # leaving the block closes the connection mid-stream


async def _alone(http: httpx.AsyncClient, spec: Spec) -> str:
    path, body = spec.body(MAX_TOKENS, stream=False)
    r = await http.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    return str(choice["message"]["content"] if spec.kind == "chat" else choice["text"])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _engine_stats(server: ServerThread) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/test/engine-stats", timeout=30)
    assert r.status_code == 200, r.text
    stats: dict[str, Any] = r.json()
    return stats


def test_64_streams_over_4_models_with_a_quarter_leaving(
    served: tuple[ServerThread, RecordingProcClient], tmp_path: Path
) -> None:
    server, client = served
    plan = _specs()

    async def run() -> tuple[dict[Spec, str], list[Outcome], float]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            # the reference: each distinct request alone, not streamed
            reference = {
                spec: await _alone(http, spec) for spec in dict.fromkeys(s for s, _ in plan)
            }
            outcomes = [Outcome(spec, leaves) for spec, leaves in plan]
            start = time.perf_counter()
            await asyncio.gather(*(_stream(http, o) for o in outcomes))
            return reference, outcomes, time.perf_counter() - start

    reference, outcomes, wall = asyncio.run(run())

    finished = [o for o in outcomes if not o.leaves]
    leavers = [o for o in outcomes if o.leaves]
    for o in outcomes:
        assert o.status == 200 and not o.errors, (o.spec, o.status, o.errors)
        assert o.request_id and o.ttft is not None
    for o in finished:
        assert o.done and o.finish_reason == "length", (o.spec, o.finish_reason)
        assert o.completion_tokens == MAX_TOKENS
        assert o.text == reference[o.spec], (o.spec, o.text, reference[o.spec])
    for o in leavers:
        assert not o.done and o.finish_reason is None

    # Aborts are sent as each server-side stream closes; wait until the engine has settled.
    deadline = time.monotonic() + 30
    while True:
        stats = _engine_stats(server)
        idle = stats["num_running"] == stats["num_waiting"] == stats["num_inflight"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    aborted = set(client.aborted_ids)
    assert {o.request_id for o in leavers} <= aborted
    assert not {o.request_id for o in finished} & aborted  # finished streams end, not abort
    assert (stats["num_running"], stats["num_waiting"], stats["num_inflight"]) == (0, 0, 0)
    # Prefix-cached blocks no request holds are on the free queue (reusable, evictable), so an
    # idle engine uses no block at all, and every usable block is free.
    assert stats["kv_blocks_used"] == 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert 0 < stats["kv_blocks_cached"] <= stats["kv_blocks_total"]
    assert stats["prefix_cache_hits"] > 0  # the repeated prompts shared blocks
    assert stats["num_preemptions"] == 0

    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    figures = {
        "clients": NUM_CLIENTS,
        "finished": len(finished),
        "left": len(leavers),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(outcomes) / wall, 2),
        "finished_per_s": round(len(finished) / wall, 2),
        "output_tokens_per_s": round(len(finished) * MAX_TOKENS / wall, 1),
        "ttft_p50_ms": round(_percentile(ttfts, 0.5) * 1000, 1),
        "ttft_p99_ms": round(_percentile(ttfts, 0.99) * 1000, 1),
        "ttft_mean_ms": round(statistics.fmean(ttfts) * 1000, 1),
        "engine": "ProcEngineClient",
    }
    (tmp_path / "load.json").write_text(json.dumps(figures, indent=2))
    print(
        f"\nLOAD-TEST: {NUM_CLIENTS} streams ({len(finished)} finished, {len(leavers)} left) "
        f"over {len(MODELS)} models in {wall:.2f} s: {figures['requests_per_s']} req/s, "
        f"{figures['output_tokens_per_s']} output tok/s; TTFT p50 {figures['ttft_p50_ms']} ms, "
        f"p99 {figures['ttft_p99_ms']} ms ({tmp_path / 'load.json'})"
    )
