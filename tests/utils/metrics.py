"""Reading a Prometheus exposition in tests: scrape ``/metrics`` and look samples up by label."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraplex.platform.settings import ServerSettings
from loraplex.server import create_app
from tests.utils.fakes import FakeEngineClient

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition: (name, labels) -> value."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def app_for(fake: FakeEngineClient, tokenizer: Any, **settings: Any) -> Any:
    return create_app(fake, ServerSettings(**settings), tokenizer=tokenizer)


def http(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def scrape(client: httpx.AsyncClient, **headers: str) -> Samples:
    r = await client.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return parse(r.text)
