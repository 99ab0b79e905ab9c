"""Does a hung webhook receiver slow requests? Concurrent completions of one tenant (the API, the
quota check, the usage rows; the fake engine, a SQLite database) while alerts stream to a
subscribed receiver, in paired phases: the receiver answers 200 at once ("ok"), or accepts and
never answers ("hang", every attempt held until the delivery timeout, all attempt slots full).
The phases alternate (ok, hang / hang, ok); each phase's p99 is its own sample.

    python -m benchmarks.webhook_hang [--rounds 6] [--concurrency 16] [--requests 25]
        [--alerts-per-s 50]

Prints JSON: each phase's p50 / p99 (ms), the medians per side, and the paired p99 differences
(hang - ok) with their median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoTokenizer

from loraplex.platform.webhooks.service import Alert, WebhookService
from tests.utils.app import add_chat_template
from tests.utils.fakes import FakeEngineClient
from tests.utils.models import TINY_VOCAB, write_tokenizer
from tests.utils.tenancy import TenancyEnv, bearer, tenancy_env
from tests.utils.webhook_receiver import HANG, Receiver

BODY = {"model": "tiny-chat", "prompt": "t30 t31", "max_tokens": 4}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _alerts(service: WebhookService, per_s: float, tag: str) -> None:
    n = 0
    while True:
        n += 1
        service.emit(Alert("engine.restarted", f"bench:{tag}:{n}", {"n": n}))
        await asyncio.sleep(1 / per_s)


async def _phase(env: TenancyEnv, key: str, url: str, args: argparse.Namespace, tag: str) -> Any:
    assert env.app.platform.tenancy is not None
    service = env.app.platform.tenancy.webhooks
    r = await env.http.post("/admin/api/webhooks", headers=env.admin_headers,
                            json={"url": url, "events": ["engine.restarted"]})  # fmt: skip
    assert r.status_code == 201, r.text
    hook = r.json()["id"]
    alerts = asyncio.create_task(_alerts(service, args.alerts_per_s, tag))
    await asyncio.sleep(0.5)  # deliveries under way (for "hang": every slot held)
    latencies: list[float] = []

    async def client() -> None:
        for _ in range(args.requests):
            began = time.perf_counter()
            r = await env.http.post("/v1/completions", headers=bearer(key), json=BODY)
            latencies.append((time.perf_counter() - began) * 1000)
            assert r.status_code == 200, r.text

    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    in_flight = len(service._sending)
    alerts.cancel()
    await env.http.delete(f"/admin/api/webhooks/{hook}", headers=env.admin_headers)
    deadline = time.monotonic() + 10
    while service._sending and time.monotonic() < deadline:  # the next phase starts clean
        await asyncio.sleep(0.1)
    return {"p50_ms": round(_pct(latencies, 0.5), 2), "p99_ms": round(_pct(latencies, 0.99), 2),
            "requests": len(latencies), "attempts_in_flight_at_end": in_flight}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = Path(tempfile.mkdtemp()) / "tiny-chat"
    write_tokenizer(model_dir, TINY_VOCAB)
    add_chat_template(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fake = FakeEngineClient(model_dir=str(model_dir))
    phases: list[dict[str, Any]] = []
    with Receiver() as ok, Receiver(default=HANG) as hang:
        async with (
            tenancy_env(Path(tempfile.mkdtemp()), fake, tokenizer) as env,
            env.app.platform.lifespan(own_client=False),
        ):
            key = env.tenant("acme")
            await _phase(env, key, ok.url, args, "warm-up")
            for i in range(args.rounds):
                order = [("ok", ok.url), ("hang", hang.url)]
                for side, url in order if i % 2 == 0 else order[::-1]:
                    result = await _phase(env, key, url, args, f"{i}-{side}")
                    phases.append({"round": i, "receiver": side, **result})
        hung_requests = len(hang.received)
    p99 = {s: [p["p99_ms"] for p in phases if p["receiver"] == s] for s in ("ok", "hang")}
    diffs = [round(h - o, 2) for o, h in zip(p99["ok"], p99["hang"], strict=True)]
    return {
        "concurrency": args.concurrency,
        "requests_per_phase": args.concurrency * args.requests,
        "alerts_per_s": args.alerts_per_s,
        "hung_attempts_received": hung_requests,
        "phases": phases,
        "median_p50_ms": {
            s: statistics.median(p["p50_ms"] for p in phases if p["receiver"] == s) for s in p99
        },
        "median_p99_ms": {s: statistics.median(v) for s, v in p99.items()},
        "paired_p99_diff_ms": diffs,
        "median_paired_p99_diff_ms": statistics.median(diffs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=25)
    parser.add_argument("--alerts-per-s", type=float, default=50.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
