"""What the stored request log adds to a request: back-to-back completions on the fake engine
and a SQLite database (the API, quotas, usage rows; no model), in alternating rounds, with the
log's rows not written (its queue takes none: ``max_queue`` 0), written, and written with the
bodies (the tenant opted in, 4,096 bytes of each).

    python -m benchmarks.request_log_overhead [--rounds 21] [--requests 30]

Prints one JSON object: each side's median time per request over the rounds, in ms.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoTokenizer

from tests.utils.app import add_chat_template
from tests.utils.fakes import FakeEngineClient
from tests.utils.models import TINY_VOCAB, write_tokenizer
from tests.utils.tenancy import bearer, tenancy_env


async def run(rounds: int, requests: int) -> dict[str, float]:
    model_dir = Path(tempfile.mkdtemp()) / "tiny-chat"
    write_tokenizer(model_dir, TINY_VOCAB)
    add_chat_template(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fake = FakeEngineClient(model_dir=str(model_dir))
    async with tenancy_env(Path(tempfile.mkdtemp()), fake, tokenizer) as env:
        assert env.app.platform.tenancy is not None
        writer = env.app.platform.tenancy.request_log
        keys = {"not written": env.tenant("plain"), "written": env.tenant("plain"),
                "written with bodies": env.tenant("bodies")}  # fmt: skip
        r = await env.http.put("/admin/api/tenants/bodies/request-log", headers=env.admin_headers,
                               json={"log_bodies": True, "body_max_bytes": 4096})  # fmt: skip
        assert r.status_code == 200, r.text
        body = {"model": "tiny-chat", "prompt": "t30 t31", "max_tokens": 4}
        times: dict[str, list[float]] = {name: [] for name in keys}
        for i in range(rounds):
            order = list(keys.items())
            order = order[i % 3 :] + order[: i % 3]
            for name, key in order:
                writer.max_queue = 0 if name == "not written" else 10_000
                began = time.perf_counter()
                for _ in range(requests):
                    r = await env.http.post("/v1/completions", headers=bearer(key), json=body)
                    assert r.status_code == 200, r.text
                times[name].append((time.perf_counter() - began) / requests * 1000)
        await writer.close()
        await env.app.platform.tenancy.usage.close()
        return {name: round(statistics.median(spent), 3) for name, spent in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    result = asyncio.run(run(args.rounds, args.requests))
    print(json.dumps({"median_ms_per_request": result, **vars(args)}, indent=2))


if __name__ == "__main__":
    main()
