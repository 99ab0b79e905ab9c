"""``loraplex bench fairness``: tenant-fair and priority scheduling, measured through the HTTP
server.

For each policy (``fcfs``, ``fair``, ...) and repeat, a fresh ``loraplex serve`` runs three
scenarios on the same model, the policies alternating (their order flips every repeat):

flood
    tenant A keeps ``flood_streams`` streams open (closed loop, ``flood_max_tokens`` each)
    against ``--max-num-seqs``; tenant B sends one request every ``b_interval_s`` s
    (``b_max_tokens``). B's time to first token (p99) and the server's output tokens/s.
shares
    A and B each keep ``share_streams`` requests open (max_tokens uniform around
    ``share_max_tokens``, so they do not finish in lockstep): each one's share of the generated tokens
    with equal weights, then with A's weight set to ``share_weight`` through the admin API on
    the running server (no restart), after ``settle_s``.
priority
    while A floods, tenant C (allowed priority ``-1``) sends priority -1 requests: admitted
    before A's queued priority-0 requests (its first token comes before theirs); B, allowed
    nothing below 0, sends one and gets a 400 naming its limit.

Writes ``fairness-<time>.json`` and ``.png`` (each tenant's share and B's TTFT over time).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loraplex.bench.common import machine
from loraplex.bench.fairness_options import FairnessOptions
from loraplex.bench.fairness_report import (
    fairness_table,
    percentile,
    round_or_none,
    series,
    shares,
    summarize,
    tokens_by_tenant,
    ttft_summary,
    write_fairness_plot,
)
from loraplex.bench.http_load import Platform, ServerProcess, StreamRecord, stream
from loraplex.bench.workload import random_text

Log = Callable[[str], None]


# ---- load ------------------------------------------------------------------------------------


@dataclass
class Load:
    """The clients of one server: the HTTP pool, the model name and the tenants' keys."""

    http: httpx.AsyncClient
    model: str
    keys: dict[str, str]
    rng: random.Random
    records: list[StreamRecord] = dataclasses.field(default_factory=list)
    tenant_ids: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> engine's id

    def prompt(self) -> str:
        return random_text(self.rng, self.rng.randint(20, 60))

    async def one(
        self,
        tenant: str,
        max_tokens: int,
        priority: int = 0,
        extra: dict[str, Any] | None = None,
        allowed: tuple[str, ...] = ("priority_not_allowed",),
    ) -> StreamRecord:
        """One request; a refusal (not 200) whose code is not in ``allowed`` raises."""
        record = await stream(
            self.http,
            self.keys[tenant],
            tenant,
            self.prompt(),
            max_tokens,
            model=self.model,
            priority=priority,
            extra=extra,
        )
        if record.status != 200 and record.error_code not in allowed:
            raise RuntimeError(f"tenant {tenant}: {record.status} {record.error}")
        self.records.append(record)
        return record

    async def closed_loop(
        self,
        tenant: str,
        streams: int,
        max_tokens: int,
        stop: asyncio.Event,
        *,
        spread: bool = False,
        extra: dict[str, Any] | None = None,
        allowed: tuple[str, ...] = ("priority_not_allowed",),
    ) -> None:
        """``streams`` requests open until ``stop``; ``spread``: each one's max_tokens drawn
        from [max_tokens / 2, max_tokens * 3 / 2] (mean ``max_tokens``), so requests do not
        finish in lockstep."""  # fmt: skip

        async def worker() -> None:
            while not stop.is_set():
                n = self.rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2)
                await self.one(tenant, n if spread else max_tokens, extra=extra, allowed=allowed)

        await asyncio.gather(*(worker() for _ in range(streams)))

    async def every(
        self, tenant: str, interval: float, until: float, max_tokens: int, priority: int = 0
    ) -> list[StreamRecord]:
        tasks = []
        while time.monotonic() < until:
            tasks.append(asyncio.create_task(self.one(tenant, max_tokens, priority)))
            await asyncio.sleep(interval)
        return list(await asyncio.gather(*tasks))


def server_means(
    before: dict[tuple[str, str], tuple[float, float]],
    after: dict[tuple[str, str], tuple[float, float]],
    tenant_ids: dict[str, str],
) -> dict[str, dict[str, float | None]]:
    """The server's mean time to first token and engine queue time per tenant (by name)
    between two ``latency_sums`` readings: where the client's TTFT went."""
    out: dict[str, dict[str, float | None]] = {}
    for name, tid in tenant_ids.items():
        means: dict[str, float | None] = {}
        for family, label in (
            ("loraplex_time_to_first_token_seconds", "server_ttft_mean_s"),
            ("loraplex_request_queue_time_seconds", "engine_queue_mean_s"),
        ):
            s0, n0 = before.get((family, tid), (0.0, 0.0))
            s1, n1 = after.get((family, tid), (0.0, 0.0))
            means[label] = round((s1 - s0) / (n1 - n0), 4) if n1 > n0 else None
        out[name] = means
    return out


async def _flood(load: Load, platform: Platform, opts: FairnessOptions) -> dict[str, Any]:
    load.records = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    flood = asyncio.create_task(
        load.closed_loop("a", opts.flood_streams, opts.flood_max_tokens, stop)
    )
    await asyncio.sleep(opts.warmup_s)
    sums = await platform.latency_sums()
    preempted = (await platform.engine())["num_preemptions"]
    start = time.monotonic()
    b = await load.every("b", opts.b_interval_s, start + opts.flood_s, opts.b_max_tokens)
    end = start + opts.flood_s
    server = server_means(sums, await platform.latency_sums(), load.tenant_ids)
    preempted = (await platform.engine())["num_preemptions"] - preempted
    stop.set()
    await flood
    tokens = tokens_by_tenant(load.records, start, end)
    return {
        "window_s": round(end - start, 2),
        "b_ttft": ttft_summary(b),
        "server": server,
        "preemptions": preempted,
        "b_ttft_over_time": [[round(r.sent - t0, 2), round_or_none(r.ttft)] for r in b],
        "output_tokens_per_s": round(sum(tokens.values()) / (end - start), 2),
        "tokens": {t: round(n, 1) for t, n in tokens.items()},
        "series": series(load.records, t0, time.monotonic()),
    }


async def _shares(load: Load, platform: Platform, opts: FairnessOptions) -> dict[str, Any]:
    load.records = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    both = [
        asyncio.create_task(
            load.closed_loop(t, opts.share_streams, opts.share_max_tokens, stop, spread=True)
        )
        for t in ("a", "b")
    ]
    await asyncio.sleep(opts.warmup_s)
    equal = (time.monotonic(), time.monotonic() + opts.share_s)
    await asyncio.sleep(opts.share_s)
    await platform.set_weight("a", opts.share_weight)  # on the running server
    changed = time.monotonic()
    await asyncio.sleep(opts.settle_s)
    weighted = (time.monotonic(), time.monotonic() + opts.share_s)
    await asyncio.sleep(opts.share_s)
    engine = await platform.engine()
    stop.set()
    await asyncio.gather(*both)
    await platform.set_weight("a", 1.0)
    return {
        "equal": {"shares": shares(tokens_by_tenant(load.records, *equal)), "weights": [1, 1]},
        "weighted": {
            "shares": shares(tokens_by_tenant(load.records, *weighted)),
            "weights": [opts.share_weight, 1],
        },
        "weight_changed_at_s": round(changed - t0, 2),
        "engine_tenants": engine.get("tenants"),
        "series": series(load.records, t0, time.monotonic()),
    }


async def _priority(load: Load, platform: Platform, opts: FairnessOptions) -> dict[str, Any]:
    """C's priority -1 requests while A floods. Just before each, the engine says how many of
    A's requests wait; C was admitted before every one of them when at least that many of A's
    earlier requests got their first token after C's (first tokens come in admission order)."""
    load.records = []
    stop = asyncio.Event()
    flood = asyncio.create_task(
        load.closed_loop("a", opts.flood_streams, opts.flood_max_tokens, stop)
    )
    await asyncio.sleep(opts.warmup_s)
    refused = await load.one("b", opts.b_max_tokens, priority=-1)
    urgent: list[tuple[int, StreamRecord]] = []
    for _ in range(opts.priority_requests):
        shares = {t["name"]: t for t in (await platform.engine()).get("tenants", ())}
        waiting = int(shares.get("a", {}).get("num_waiting", 0))
        urgent.append((waiting, await load.one("c", opts.b_max_tokens, priority=-1)))
        await asyncio.sleep(opts.b_interval_s)
    stop.set()
    await flood
    trials: list[dict[str, Any]] = []
    admitted_first = 0
    for waiting, c in urgent:
        overtaken = sum(
            1
            for r in load.records
            if r.tenant == "a" and r.sent < c.sent and c.first is not None
            and (r.first is None or r.first > c.first)
        )  # fmt: skip
        admitted_first += overtaken >= waiting
        trials.append({"ttft_s": round_or_none(c.ttft), "a_waiting": waiting,
                       "a_overtaken": overtaken})  # fmt: skip
    a_ttft = [r.ttft for r in load.records if r.tenant == "a" and r.ttft is not None]
    return {
        "trials": trials,
        "admitted_before_all_queued": admitted_first,
        "urgent_ttft_p50_s": round_or_none(percentile([t["ttft_s"] or 0.0 for t in trials], 50)),
        "queued_ttft_p50_s": round_or_none(percentile(a_ttft, 50)),
        "not_allowed": {
            "status": refused.status,
            "code": refused.error_code,
            "message": refused.error,
        },
    }


async def _scenarios(server: ServerProcess, opts: FairnessOptions, log: Log) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=timeout) as http:
        platform = Platform(http, server.admin_token)
        keys = {
            "a": await platform.tenant("a"),
            "b": await platform.tenant("b"),
            "c": await platform.tenant("c", max_priority=-1),
        }
        models = await http.get("/v1/models", headers={"Authorization": f"Bearer {keys['a']}"})
        model = models.json()["data"][0]["id"]
        load = Load(http, model, keys, random.Random(opts.seed))
        for tenant in keys:  # warm each tenant's path; the engine then knows its id
            await load.one(tenant, 4)
        engine = await platform.engine()
        load.tenant_ids = {
            t["name"]: t["tenant_id"] for t in engine.get("tenants", ()) if t["name"]
        }
        log("    flood ...")
        flood = await _flood(load, platform, opts)
        log(
            f"    flood: B p99 TTFT {flood['b_ttft']['p99_s']} s, "
            f"{flood['output_tokens_per_s']} output tok/s"
        )
        log("    shares ...")
        share = await _shares(load, platform, opts)
        log(f"    shares: equal {share['equal']['shares']}, weighted {share['weighted']['shares']}")
        log("    priority ...")
        prio = await _priority(load, platform, opts)
        log(
            f"    priority: {prio['admitted_before_all_queued']}/{len(prio['trials'])} admitted "
            f"first; not allowed: {prio['not_allowed']['status']}"
        )
        return {"flood": flood, "shares": share, "priority": prio}


def run_policy(opts: FairnessOptions, policy: str, log: Log) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loraplex-fairness-") as tmp:
        args = [
            *([opts.model] if opts.model else []),
            "--scheduling-policy",
            policy,
            "--max-num-seqs",
            str(opts.max_num_seqs),
            "--log-level",
            "warning",
            *opts.extra_serve_args,
        ]
        server = ServerProcess(args, Path(tmp), secrets.token_urlsafe(24))
        with server:
            try:
                return asyncio.run(_scenarios(server, opts, log))
            except Exception as exc:
                raise RuntimeError(f"{policy}: {exc}\nserver log:\n{server.log_tail()}") from exc


# ---- the run ---------------------------------------------------------------------------------


def run_fairness(opts: FairnessOptions, log: Log = print) -> dict[str, Any]:
    runs = []
    for repeat in range(opts.repeats):
        order = opts.policies if repeat % 2 == 0 else tuple(reversed(opts.policies))
        for policy in order:
            log(f"repeat {repeat + 1}/{opts.repeats}, policy {policy}: starting the server ...")
            runs.append(
                {"repeat": repeat, "policy": policy, "result": run_policy(opts, policy, log)}
            )
    result: dict[str, Any] = {
        "benchmark": "fairness",
        "command": opts.command_line(),
        "options": dataclasses.asdict(opts) | {"model": opts.model or "embedded"},
        "machine": machine(),
        "summary": summarize(runs, opts.policies, opts.repeats),
        "runs": runs,
    }
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"fairness-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    skipped = write_fairness_plot(result, stem.with_suffix(".png"))
    log(fairness_table(result["summary"]))
    log(f"wrote {stem}.json" + (f" ({skipped})" if skipped else f" and {stem}.png"))
    return result
