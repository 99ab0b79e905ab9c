"""What a budget adds to a request: back-to-back completions of one tenant without a budget and
of another with a monthly token budget, on the fake engine and a SQLite database (the API, the
quota and budget checks, the usage rows; no model), in alternating rounds.

    python -m benchmarks.budget_request_overhead [--rounds 10] [--requests 30]

Prints each side's median time per request over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
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


async def run(rounds: int, requests: int) -> None:
    model_dir = Path(tempfile.mkdtemp()) / "tiny-chat"
    write_tokenizer(model_dir, TINY_VOCAB)
    add_chat_template(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fake = FakeEngineClient(model_dir=str(model_dir))
    async with tenancy_env(Path(tempfile.mkdtemp()), fake, tokenizer) as env:
        keys = {"no budget": env.tenant("plain"), "budget": env.tenant("budgeted")}
        r = await env.http.post(
            "/admin/api/tenants/budgeted/budgets",
            headers=env.admin_headers,
            json={"metric": "tokens", "period": "month", "limit": 1e12},
        )
        assert r.status_code == 201, r.text
        body = {"model": "tiny-chat", "prompt": "t30 t31", "max_tokens": 4}
        times: dict[str, list[float]] = {name: [] for name in keys}
        for i in range(rounds):
            order = list(keys.items()) if i % 2 else list(keys.items())[::-1]
            for name, key in order:
                began = time.perf_counter()
                for _ in range(requests):
                    r = await env.http.post("/v1/completions", headers=bearer(key), json=body)
                    assert r.status_code == 200, r.text
                times[name].append((time.perf_counter() - began) / requests * 1000)
        for name, spent in times.items():
            print(f"{name}: median {statistics.median(spent):.2f} ms per request")
        assert env.app.platform.tenancy is not None
        await env.app.platform.tenancy.budgets.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    asyncio.run(run(args.rounds, args.requests))


if __name__ == "__main__":
    main()
