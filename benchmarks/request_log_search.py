"""The request log's searches through the admin API, among ``--rows`` rows: a lookup by
request id (``GET /admin/api/requests/{id}``, the acceptance case: under 200 ms), a filtered
page (one tenant's 5xx of the last day), a page filtered by key, and the third page of the
newest rows (by cursor).

    python -m benchmarks.request_log_search [--rows 100000] [--repeat 30] [--postgres]

Rows spread over 20 tenants (3 keys each), 5 models, 90 % 2xx / 8 % 4xx / 2 % 5xx, the last 7
days. The app is the real one (``loraplex.server.create_app``, fake engine, in-process httpx
client: the time includes routing, authentication, the query and JSON); ``--postgres`` runs
on a PostgreSQL server started for the run (tests/utils/pg.py), else on a SQLite file. Prints
one JSON object: per case the median, p90 and max of ``--repeat`` calls in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import insert

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loraplex.platform import tenants
from loraplex.platform.db.models import RequestLogEntry
from loraplex.platform.settings import ServerSettings
from loraplex.server import create_app
from tests.utils.fakes import FakeEngineClient
from tests.utils.models import TINY_VOCAB, write_tokenizer
from tests.utils.tenancy import ADMIN_TOKEN, bearer, platform_for

TENANTS = 20
KEYS = 3
MODELS = ("tiny", "pirate@1", "pirate@2", "caps@1", "summarize@3")


def fill(store: Any, rows: int) -> tuple[list[str], list[str]]:
    """``rows`` log rows; returns the request ids and the key public ids."""
    rng = random.Random(0)
    now = dt.datetime.now(dt.timezone.utc)
    owners: list[tuple[int, str]] = []
    with store.db.session() as session:
        for t in range(TENANTS):
            tenant = tenants.create_tenant(session, "admin", f"t{t}", quotas=tenants.Quotas())
            for _ in range(KEYS):
                key, _new = tenants.create_key(session, "admin", tenant)
                owners.append((tenant.id, key.public_id))
    ids = [f"chatcmpl-{rng.getrandbits(128):032x}" for _ in range(rows)]
    batch = []
    for i, rid in enumerate(ids):
        tenant_id, key_id = owners[rng.randrange(len(owners))]
        roll = rng.random()
        status = 200 if roll < 0.90 else (rng.choice((400, 404, 422, 429)) if roll < 0.98 else 500)
        batch.append({
            "created_at": now - dt.timedelta(days=7) * (1 - i / rows),
            "tenant_id": tenant_id, "key_id": key_id, "method": "POST",
            "endpoint": "/v1/chat/completions", "model": MODELS[i % len(MODELS)],
            "served_model": MODELS[i % len(MODELS)], "status": status,
            "error_code": None if status == 200 else "some_error", "prompt_tokens": 50,
            "completion_tokens": 20, "ttft_ms": 12.5, "duration_ms": 80.0,
            "finish_reason": "stop", "request_id": rid, "stream": False,
        })  # fmt: skip
    with store.db.session() as session:
        for i in range(0, rows, 10_000):
            session.execute(insert(RequestLogEntry), batch[i : i + 10_000])
    return ids, [key for _, key in owners]


async def timed(http: httpx.AsyncClient, url: str, repeat: int, check: Any) -> dict[str, Any]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        r = await http.get(url, headers=bearer(ADMIN_TOKEN))
        times.append((time.perf_counter() - start) * 1000)
        assert r.status_code == 200, r.text
        check(r.json())
    times.sort()
    return {
        "url": url,
        "median_ms": round(statistics.median(times), 2),
        "p90_ms": round(times[int(len(times) * 0.9) - 1], 2),
        "max_ms": round(times[-1], 2),
    }


async def run(rows: int, repeat: int, url: str | None) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp())
    store = platform_for(folder, **({"database_url": url} if url else {}))
    start = time.perf_counter()
    ids, keys = fill(store, rows)
    fill_s = time.perf_counter() - start
    write_tokenizer(folder / "tok", TINY_VOCAB)
    app = create_app(FakeEngineClient(model_dir=str(folder / "tok")), ServerSettings(), store=store)
    rng = random.Random(1)
    since = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
        await http.get("/admin/api/requests?limit=1", headers=bearer(ADMIN_TOKEN))  # warm up
        target = ids[rng.randrange(rows)]
        cases = {
            "by_request_id": await timed(
                http, f"/admin/api/requests/{target}", repeat,
                lambda body: body["request_id"] == target or sys.exit("wrong row"),
            ),
            "page_tenant_5xx_last_day": await timed(
                http, f"/admin/api/requests?tenant=t3&status=5xx&since={since}&limit=50",
                repeat, lambda body: None,
            ),
            "page_key": await timed(
                http, f"/admin/api/requests?key={keys[5]}&limit=100", repeat, lambda body: None,
            ),
            "filter_request_id": await timed(
                http, f"/admin/api/requests?request_id={target}", repeat,
                lambda body: len(body["data"]) == 1 or sys.exit("not found"),
            ),
        }  # fmt: skip
        first = await http.get("/admin/api/requests?limit=100", headers=bearer(ADMIN_TOKEN))
        cursor = first.json()["next_cursor"]
        cases["page_by_cursor"] = await timed(
            http, f"/admin/api/requests?limit=100&cursor={cursor}", repeat, lambda body: None
        )
        # Again, last: the first cases run while PostgreSQL's autovacuum is still busy with
        # the freshly loaded table (on a small machine that shows in their times).
        cases["by_request_id_again"] = await timed(
            http, f"/admin/api/requests/{target}", repeat,
            lambda body: body["request_id"] == target or sys.exit("wrong row"),
        )  # fmt: skip
    store.db.dispose()
    return {
        "database": "postgresql" if url else "sqlite",
        "rows": rows,
        "repeat": repeat,
        "fill_s": round(fill_s, 1),
        "cases": cases,
        "by_request_id_under_200ms": max(
            cases["by_request_id"]["median_ms"], cases["by_request_id_again"]["median_ms"]
        )
        < 200,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--postgres", action="store_true")
    args = parser.parse_args()
    if not args.postgres:
        result = asyncio.run(run(args.rows, args.repeat, None))
    else:
        from tests.utils.pg import PostgresServer

        server = PostgresServer.start()
        try:
            result = asyncio.run(run(args.rows, args.repeat, server.create_database()))
        finally:
            server.stop()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
