"""``python -m benchmarks.masks``: does one tenant's costly constraint slow another tenant?

One ``loraplex serve`` (policy ``--policy``); tenant A keeps ``--streams`` requests open
(closed loop, ``--a-max-tokens`` each), in alternating windows without a constraint and with
``--regex`` as ``guided_regex``; tenant B sends one unconstrained request every ``--b-interval-s``.
Each window reports B's TTFT (p50, p90) and what became of A's requests; the summary is the
median over the repeats of B's p90 with the heavy constraint over B's p90 with the plain one
(issue 31's target: at most 1.5, masks cost no more than plain load).

The default pattern is the costliest kind the engine accepts (nested counts multiplying to
9,261 copies, just under the precheck's 10,000): about 2.3 ms of mask work per row per step on
a Zen 4 core. Issue 31's ``((a{60}){60}){60}`` (216,000 copies, 30-60 ms a row) is now refused
at admission with a 400 ``invalid_constraint``; pass it as ``--regex`` to see that.

Writes ``masks-<time>.json``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.masks.options import MaskOptions
from loraplex.bench.common import machine
from loraplex.bench.fairness import Load
from loraplex.bench.fairness_report import percentile, round_or_none
from loraplex.bench.http_load import Platform, ServerProcess, StreamRecord

Log = Callable[[str], None]
TARGET_RATIO = 1.5


def _b_ttft(records: list[StreamRecord]) -> dict[str, Any]:
    ttfts = [r.ttft for r in records if r.ttft is not None]
    return {
        "n": len(ttfts),
        "errors": sum(1 for r in records if r.error_code or r.status != 200),
        "p50_s": round_or_none(percentile(ttfts, 50)),
        "p90_s": round_or_none(percentile(ttfts, 90)),
    }


async def _window(load: Load, opts: MaskOptions, constrained: bool) -> dict[str, Any]:
    load.records = []
    stop = asyncio.Event()
    extra = {"guided_regex": opts.regex} if constrained else None
    flood = asyncio.create_task(
        load.closed_loop(
            "a",
            opts.streams,
            opts.a_max_tokens,
            stop,
            extra=extra,
            allowed=("constraint_too_costly", "invalid_constraint"),
        )
    )
    await asyncio.sleep(opts.warmup_s)
    start = time.monotonic()
    b = await load.every("b", opts.b_interval_s, start + opts.window_s, opts.b_max_tokens)
    stop.set()
    await flood
    a = [r for r in load.records if r.tenant == "a" and r.sent >= start]
    codes: dict[str, int] = {}
    for r in a:
        key = r.error_code or ("ok" if r.status == 200 else str(r.status))
        codes[key] = codes.get(key, 0) + 1
    return {
        "constrained": constrained,
        "b_ttft": _b_ttft(b),
        "a_requests": codes,
        "a_tokens": sum(r.tokens for r in a),
    }


async def _run(server: ServerProcess, opts: MaskOptions, log: Log) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(
        base_url=server.base_url, limits=limits, timeout=httpx.Timeout(600.0)
    ) as http:
        platform = Platform(http, server.admin_token)
        keys = {"a": await platform.tenant("a"), "b": await platform.tenant("b")}
        models = await http.get("/v1/models", headers={"Authorization": f"Bearer {keys['a']}"})
        load = Load(http, models.json()["data"][0]["id"], keys, random.Random(opts.seed))
        await load.one("a", 2, extra={"guided_regex": opts.regex},
                       allowed=("constraint_too_costly", "invalid_constraint"))  # fmt: skip
        await load.one("b", 2)  # compiled and warm before any window
        windows = []
        for repeat in range(opts.repeats):
            for constrained in (False, True) if repeat % 2 == 0 else (True, False):
                w = await _window(load, opts, constrained)
                log(f"  repeat {repeat + 1}, {'heavy' if constrained else 'plain'}: B {w['b_ttft']}"
                    f", A {w['a_requests']}")  # fmt: skip
                windows.append({"repeat": repeat, **w})
        return windows


def summarize(windows: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    ratios = []
    for i in range(repeats):
        heavy, plain = (
            next(w for w in windows if w["repeat"] == i and w["constrained"] is c)
            for c in (True, False)
        )
        h, p = heavy["b_ttft"]["p90_s"], plain["b_ttft"]["p90_s"]
        if h is not None and p:
            ratios.append(round(h / p, 3))
    median = round(statistics.median(ratios), 3) if ratios else None
    return {
        "b_p90_heavy_over_plain": ratios,
        "median_b_p90_heavy_over_plain": median,
        "target": TARGET_RATIO,
        "met": median is not None and median <= TARGET_RATIO,
    }


def run_masks(opts: MaskOptions, log: Log = print) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loraplex-masks-") as tmp:
        args = ["--scheduling-policy", opts.policy, "--log-level", "warning"]
        server = ServerProcess(args, Path(tmp), secrets.token_urlsafe(24))
        with server:
            try:
                windows = asyncio.run(_run(server, opts, log))
            except Exception as exc:
                raise RuntimeError(f"{exc}\nserver log:\n{server.log_tail()}") from exc
    result = {
        "benchmark": "masks",
        "command": opts.command_line(),
        "options": dataclasses.asdict(opts),
        "machine": machine(),
        "summary": summarize(windows, opts.repeats),
        "windows": windows,
    }
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"masks-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    log(json.dumps(result["summary"]))
    log(f"wrote {path}")
    return result
