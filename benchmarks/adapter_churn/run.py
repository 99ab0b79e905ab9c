"""``python -m benchmarks.adapter_churn`` (issue 30): two tenants' adapter traffic through the HTTP
server against a device adapter pool smaller than the adapters in use.

One ``loraplex serve`` with the scenario's flags; tenant B uploads its adapter, then tenant A
its ``num_adapters`` (random PEFT adapters written at bench time: same rank and target modules,
fp16, small ``B`` so that outputs stay sane). Then, in order:

cold
    with the server idle, B's first request on its never-used adapter against its next three
    (warm): the cold load's extra time to first token, and the tiers it crossed.
alone
    B alone for ``alone_s``: one streamed request at a time, or one every ``b_interval_s``.
baseline
    A keeps ``concurrency`` requests (``a_max_tokens`` each) going on ONE adapter while B sends.
churn
    the same, over A's ``num_adapters`` adapters round robin.

Per phase: B's TTFT p50/p90/p99 (completed requests), errors per tenant with their codes and
first messages (a refused, failed or cut stream), A's completed requests and output tokens/s in
B's window, and the deltas of the engine counters the platform exports on ``/metrics``
(restarts, steps, slot and host loads and evictions, deferrals, ...), read every ``sample_s``:
the platform keeps them monotonic across engine restarts but loses what an engine counted
after the last reading before it died, so frequent readings lose little. Writes
``adapter-churn-<scenario>-<time>.json`` and ``.png``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import random
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import Metric

from benchmarks.adapter_churn.options import ChurnOptions
from benchmarks.adapter_churn.report import (
    PLOTTED,
    Sent,
    churn_table,
    counter_deltas,
    error_summary,
    median_or_none,
    summarize,
    ttft_summary,
    write_churn_plot,
)
from loraplex.bench.common import machine
from loraplex.bench.fairness_report import round_or_none
from loraplex.bench.http_load import Platform, ServerError, ServerProcess, stream
from loraplex.bench.workload import random_text

Log = Callable[[str], None]
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
# B ~ N(0, B_STD^2 / rank), A ~ N(0, 1 / fan_in): the update is a few % of the activations.
B_STD = 0.02
ERROR_PAUSE_S = 0.2  # after a failed request: a refusal is instant, no busy loop against it
HEALTHY_WAIT_S = 180.0  # after a phase, for an engine that is restarting
READ_TIMEOUT_S = 120.0  # a stream silent this long is a failure
COLD_PROMPT_WORDS = 40  # cold and warm requests: prompts of one length (different words)


# ---- adapters --------------------------------------------------------------------------------


def module_shapes(model_dir: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """The model's layer count and each projection's (fan_in, fan_out), from config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, int(cfg.get("num_key_value_heads") or heads) * head_dim
    inter = int(cfg["intermediate_size"])
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}  # fmt: skip
    return int(cfg["num_hidden_layers"]), shapes


def write_adapter(model_dir: str, out: Path, rank: int, targets: Sequence[str], seed: int) -> Path:
    """A random PEFT LoRA adapter (fp16 safetensors, ``lora_alpha = 2 * rank``) in ``out``."""
    import torch
    from safetensors.torch import save_file

    layers, shapes = module_shapes(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer, module in itertools.product(range(layers), targets):
        fan_in, fan_out = shapes[module]
        prefix = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
        a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5  # [r, in]
        b = torch.randn(fan_out, rank, generator=gen) * (B_STD / rank**0.5)  # [out, r]
        tensors[f"{prefix}.lora_A.weight"] = a.half()
        tensors[f"{prefix}.lora_B.weight"] = b.half()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": model_dir}  # fmt: skip
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out


def write_adapters(opts: ChurnOptions, model_dir: str, root: Path) -> dict[str, Path]:
    """B's adapter ``b-0`` and A's ``a-0`` .. ``a-{N-1}``, each from its own seed."""
    names = ["b-0", *(f"a-{k}" for k in range(opts.num_adapters))]
    rank, targets = opts.rank, opts.target_modules
    seeds = {name: opts.seed * 1_000_003 + i for i, name in enumerate(names)}
    return {n: write_adapter(model_dir, root / n, rank, targets, seeds[n]) for n in names}


async def upload(http: httpx.AsyncClient, key: str, name: str, directory: Path) -> str:
    """Upload ``directory`` as the caller's adapter ``name``; its model name in the API."""
    files = [("files", (n, (directory / n).read_bytes())) for n in (CONFIG, WEIGHTS)]
    r = await http.post("/v1/adapters", headers=_auth(key), data={"name": name}, files=files)
    if r.status_code != 201:
        raise ServerError(f"uploading adapter {name}: {r.status_code} {r.text[:300]}")
    return str(r.json()["id"])


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- engine counters -------------------------------------------------------------------------


def _series() -> dict[tuple[str, str | None], str]:
    """(metric family, tier label) -> counter name, for every engine counter on /metrics."""
    from loraplex.platform.metrics import ENGINE_COUNTERS

    names = {(c.name, c.tier): c.key.removeprefix("lora_") for c in ENGINE_COUNTERS}
    return names | {("loraplex_engine_restarts", None): "engine_restarts"}


async def scrape(http: httpx.AsyncClient, headers: dict[str, str]) -> list[Metric]:
    """``/metrics`` now, parsed by Prometheus' own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    r = await http.get("/metrics", headers=headers)
    if not r.is_success:
        raise ServerError(f"GET /metrics: {r.status_code} {r.text[:200]}")
    return list(text_string_to_metric_families(r.text))


async def read_counters(http: httpx.AsyncClient, headers: dict[str, str]) -> dict[str, float]:
    """The engine counters' totals now, and ``healthy`` (1 or 0), from ``/metrics``."""
    series, out = _series(), {}
    for family in await scrape(http, headers):
        for sample in family.samples:
            if sample.name == "loraplex_engine_healthy":
                out["healthy"] = sample.value
            elif sample.name == f"{family.name}_total":
                key = series.get((family.name, sample.labels.get("tier")))
                if key is not None:
                    out[key] = sample.value
    return out


SERVER_TIMES = {  # histogram family -> key: where B's time to first token went, server side
    "loraplex_request_queue_time_seconds": "queue",
    "loraplex_time_to_first_token_seconds": "ttft",
}


async def server_times(
    http: httpx.AsyncClient, headers: dict[str, str], model: str
) -> dict[str, float]:
    """``model``'s server-side queue time and time to first token so far, from ``/metrics``:
    ``<key>_sum`` and ``<key>_count`` per histogram of ``SERVER_TIMES``."""
    out: dict[str, float] = {}
    for family in await scrape(http, headers):
        key = SERVER_TIMES.get(family.name)
        for sample in family.samples if key else ():
            suffix = sample.name.removeprefix(family.name)
            label = sample.labels.get("model", "")  # name@version
            if label.partition("@")[0] == model and suffix in ("_sum", "_count"):
                out[f"{key}{suffix}"] = out.get(f"{key}{suffix}", 0.0) + sample.value
    return out


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Mean queue time and time to first token (s) of the requests counted between two
    ``server_times`` readings: the engine's side of B's client-measured TTFT."""
    out: dict[str, Any] = {}
    for key in SERVER_TIMES.values():
        n = after.get(f"{key}_count", 0.0) - before.get(f"{key}_count", 0.0)
        total = after.get(f"{key}_sum", 0.0) - before.get(f"{key}_sum", 0.0)
        out[f"{key}_mean_s"] = round(total / n, 4) if n > 0 else None
        out[f"{key}_n"] = int(n)
    return out


@dataclass
class Sampler:
    """``read_counters`` every ``every`` s until stopped; /health's reason when unhealthy."""

    http: httpx.AsyncClient
    headers: dict[str, str]
    every: float
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    down: list[str] = field(default_factory=list)  # distinct reasons the engine was down

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                values = await read_counters(self.http, self.headers)
                self.samples.append((time.monotonic(), values))
                if not values.get("healthy"):
                    reason = (await self.http.get("/health")).json()["engine"].get("reason")
                    if reason and reason not in self.down:
                        self.down.append(str(reason)[:300])
            except (httpx.HTTPError, ServerError, ValueError, KeyError):
                pass  # a missed reading; the next one counts
            with contextlib.suppress(TimeoutError):  # the next reading is due
                await asyncio.wait_for(stop.wait(), self.every)

    def over_time(self, t0: float) -> dict[str, list[float]]:
        """Each plotted counter since the first sample, by seconds since ``t0``."""
        if not self.samples:
            return {"t": [], "engine_restarts": [], **{k: [] for k in PLOTTED}}
        first = self.samples[0][1]
        out: dict[str, list[float]] = {"t": [round(t - t0, 2) for t, _ in self.samples]}
        for key in (*PLOTTED, "engine_restarts"):
            out[key] = [v.get(key, 0.0) - first.get(key, 0.0) for _, v in self.samples]
        return out


# ---- load ------------------------------------------------------------------------------------


@dataclass
class Clients:
    """The two tenants' clients on one server."""

    http: httpx.AsyncClient
    platform: Platform
    opts: ChurnOptions
    keys: dict[str, str]
    rng: random.Random
    sent: list[tuple[str, Sent]] = field(default_factory=list)  # (tenant, request)

    async def send(self, tenant: str, model: str, max_tokens: int, words: int = 0) -> Sent:
        """One streamed request; its prompt has ``words`` words (0: 20 to 60, drawn)."""
        prompt = random_text(self.rng, words or self.rng.randint(20, 60))
        record = await stream(self.http, self.keys[tenant], tenant, prompt, max_tokens,
                              model=model)  # fmt: skip
        sent = Sent(record, model, max_tokens)
        self.sent.append((tenant, sent))
        if not sent.ok:
            await asyncio.sleep(ERROR_PAUSE_S)
        return sent

    async def a_load(self, models: Sequence[str], stop: asyncio.Event) -> None:
        """``concurrency`` requests open until ``stop``, over ``models`` round robin."""
        order = itertools.count()

        async def worker() -> None:
            while not stop.is_set():
                model = models[next(order) % len(models)]
                await self.send("a", model, self.opts.a_max_tokens)

        await asyncio.gather(*(worker() for _ in range(self.opts.concurrency)))

    async def b_load(self, model: str, until: float) -> list[Sent]:
        """B's requests sent before ``until``: back to back, or one every ``b_interval_s``."""
        if self.opts.b_interval_s == 0:
            out = []
            while time.monotonic() < until:
                out.append(await self.send("b", model, self.opts.b_max_tokens))
            return out
        tasks = []
        while time.monotonic() < until:
            tasks.append(asyncio.create_task(self.send("b", model, self.opts.b_max_tokens)))
            await asyncio.sleep(self.opts.b_interval_s)
        return list(await asyncio.gather(*tasks))

    async def counters(self) -> dict[str, float]:
        """``read_counters`` from a scrape the engine answered (a busy or restarting engine may
        miss one: its counters are then absent or stale), trying for ``HEALTHY_WAIT_S``."""
        deadline = time.monotonic() + HEALTHY_WAIT_S
        while True:
            values = await read_counters(self.http, self.platform.headers)
            if values.get("healthy") or time.monotonic() > deadline:
                return values
            await asyncio.sleep(0.5)

    async def healthy(self) -> bool:
        """Wait (up to ``HEALTHY_WAIT_S``) until /health says the engine serves."""
        deadline = time.monotonic() + HEALTHY_WAIT_S
        while time.monotonic() < deadline:
            try:
                if (await self.http.get("/health")).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
        return False


async def cold_load(c: Clients, base: str, warm: str, cold: str, weights: int) -> dict[str, Any]:
    """B's first request on its never-used adapter ``cold`` (the server idle; the base model's
    and the LoRA path warmed on ``warm`` first) against its next three."""
    c.sent = []
    await c.send("b", base, c.opts.b_max_tokens)
    for _ in range(2):
        await c.send("a", warm, c.opts.a_max_tokens)
    before = await c.counters()
    first = await c.send("b", cold, c.opts.b_max_tokens, COLD_PROMPT_WORDS)
    crossed = counter_deltas(before, await c.counters())
    warm_ttfts = []
    for _ in range(3):
        s = await c.send("b", cold, c.opts.b_max_tokens, COLD_PROMPT_WORDS)
        if s.ok and s.record.ttft is not None:
            warm_ttfts.append(s.record.ttft)
    cold_ttft = first.record.ttft if first.ok else None
    warm_median = median_or_none(warm_ttfts)
    return {
        "adapter": cold,
        "weights_bytes": weights,
        "cold_ttft_s": round_or_none(cold_ttft),
        "warm_ttft_s": warm_median,
        "extra_ttft_s": None
        if cold_ttft is None or warm_median is None
        else round(cold_ttft - warm_median, 4),
        "counters": {k: crossed.get(k) for k in ("disk_loads", "slot_loads", "slot_evictions")},
        "error": None if first.ok else first.problem(),
        "errors": {t: error_summary([s for u, s in c.sent if u == t]) for t in ("a", "b")},
    }


async def phase(
    c: Clients, b_model: str, a_models: Sequence[str], window_s: float
) -> dict[str, Any]:
    """B's window of ``window_s`` beside A's load on ``a_models`` (none: B alone)."""
    c.sent = []
    sampler = Sampler(c.http, c.platform.headers, c.opts.sample_s)
    sampling_done = asyncio.Event()
    t0 = time.monotonic()
    before = await c.counters()
    b_before = await server_times(c.http, c.platform.headers, b_model)
    sampling = asyncio.create_task(sampler.run(sampling_done))
    stop = asyncio.Event()
    a_task = asyncio.create_task(c.a_load(a_models, stop)) if a_models else None
    if a_task is not None:
        await asyncio.sleep(c.opts.warmup_s)
    start = time.monotonic()
    b = await c.b_load(b_model, start + window_s)
    end = time.monotonic()
    stop.set()
    if a_task is not None:
        await a_task  # every request A sent has ended: completed or failed
    came_back = await c.healthy()
    sampling_done.set()
    await sampling
    after = await c.counters()
    b_server = server_means(b_before, await server_times(c.http, c.platform.headers, b_model))
    sampler.samples.append((time.monotonic(), after))  # the series ends at the phase's totals
    a = [s for t, s in c.sent if t == "a"]
    a_tokens = sum(s.record.tokens_between(start, end) for s in a)
    return {
        "a_adapters": len(a_models),
        "window_s": round(end - start, 2),
        "b_ttft": ttft_summary(b),
        "b_server": b_server,
        "a": {
            "sent": len(a),
            "completed": sum(s.ok for s in a),
            "failed": sum(not s.ok for s in a),
            "output_tokens_per_s": round(a_tokens / (end - start), 2),
        },
        "errors": {t: error_summary([s for u, s in c.sent if u == t]) for t in ("a", "b")},
        "engine": counter_deltas(before, after),
        "engine_healthy_at_end": came_back,
        "engine_down_reasons": sampler.down[:5],
        "b_ttft_over_time": [  # [sent at (s into the window), TTFT or None, completed]
            [round(s.record.sent - start, 2), round_or_none(s.record.ttft), s.ok] for s in b
        ],
        "counters_over_time": sampler.over_time(t0),
    }


async def _bench(server: ServerProcess, opts: ChurnOptions, dirs: dict[str, Path],
                 log: Log) -> dict[str, Any]:  # fmt: skip
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=timeout) as http:
        platform = Platform(http, server.admin_token)
        keys = {"a": await platform.tenant("a"), "b": await platform.tenant("b")}
        base = (await http.get("/v1/models", headers=_auth(keys["a"]))).json()["data"][0]["id"]
        log(f"uploading 1 + {opts.num_adapters} adapters ...")
        b_model = await upload(http, keys["b"], "b-0", dirs["b-0"])  # first: the coldest
        a_models = [await upload(http, keys["a"], f"a-{k}", dirs[f"a-{k}"])
                    for k in range(opts.num_adapters)]  # fmt: skip
        c = Clients(http, platform, opts, keys, random.Random(opts.seed))
        weights = (dirs["b-0"] / WEIGHTS).stat().st_size
        cold = await cold_load(c, base, a_models[0], b_model, weights)
        log(f"cold load: {cold['cold_ttft_s']} s first TTFT, {cold['warm_ttft_s']} s warm")
        plan = [("alone", [], opts.alone_s), ("baseline", a_models[:1], opts.duration_s),
                ("churn", a_models, opts.duration_s)]  # fmt: skip
        phases: dict[str, dict[str, Any]] = {}
        for name, models, window in plan:
            if window <= 0:
                continue
            log(f"{name}: {len(models)} adapters for A, {window:g} s ...")
            p = phases[name] = await phase(c, b_model, models, window)
            log(f"  B p90 TTFT {p['b_ttft']['p90_s']} s; errors A {p['errors']['a']['count']} "
                f"B {p['errors']['b']['count']}; restarts {p['engine'].get('engine_restarts')}")  # fmt: skip
        return {"base_model": base, "cold_load": cold, "phases": phases}


# ---- the run ---------------------------------------------------------------------------------


def cpu_model() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return m.group(1).strip() if m else None


def log_problems(path: Path, limit: int = 20) -> dict[str, Any]:
    """The server log's lines that say something went wrong (the first ``limit``)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"count": 0, "first": []}
    bad = [ln for ln in lines if re.search(r"error|restart|died|traceback|killed", ln, re.I)]
    return {"count": len(bad), "first": [ln[:400] for ln in bad[:limit]]}


def run_adapter_churn(opts: ChurnOptions, log: Log = print) -> dict[str, Any]:
    from loraplex.engine.default_model import resolve_model_dir

    model_dir = opts.model or str(resolve_model_dir(None))
    with tempfile.TemporaryDirectory(prefix="loraplex-churn-") as tmp:
        dirs = write_adapters(opts, model_dir, Path(tmp, "adapters"))
        log(f"starting loraplex serve {' '.join(opts.serve_args())} ...")
        server = ServerProcess(opts.serve_args(), Path(tmp, "server"), secrets.token_urlsafe(24))
        with server:
            try:
                measured = asyncio.run(_bench(server, opts, dirs, log))
            except Exception as exc:
                raise RuntimeError(f"{exc}\nserver log:\n{server.log_tail()}") from exc
            problems = log_problems(server.log_path)
    result: dict[str, Any] = {
        "benchmark": "adapter-churn",
        "command": opts.command_line(),
        "options": dataclasses.asdict(opts) | {"model": opts.model or "embedded"},
        "server_args": opts.serve_args(),
        "machine": machine() | {"cpu_model": cpu_model()},
        **measured,
        "summary": summarize(measured["cold_load"], measured["phases"]),
        "server_log_problems": problems,
    }
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"adapter-churn-{opts.scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    skipped = write_churn_plot(result, stem.with_suffix(".png"))
    log(churn_table(result))
    log(f"wrote {stem}.json" + (f" ({skipped})" if skipped else f" and {stem}.png"))
    return result
