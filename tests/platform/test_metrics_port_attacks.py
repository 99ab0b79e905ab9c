"""The unauthenticated ``--metrics-port`` as an outsider sees it: the model server protocol's
``vllm:`` families and nothing else. The main port's ``/metrics`` (behind the admin or metrics
token) keeps the ``loraplex_*`` families, whose labels name tenants (by id) and their adapters
and whose values are each tenant's traffic."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.info import NO_TENANT, TenantStats
from loraplex.platform.metrics_http import MetricsServer
from loraplex.platform.metrics_port import MetricsSnapshot
from tests.utils.tenancy import bearer

pytestmark = pytest.mark.anyio

MODEL = "tiny-chat"


async def test_metrics_port_serves_only_the_protocols_families(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme")
    r = await env.http.post(
        "/v1/completions",
        headers=bearer(key),
        json={"model": MODEL, "prompt": "t30 t31", "max_tokens": 3},
    )
    assert r.status_code == 200, r.text
    env.fake.engine_stats = {"tenants": {"1": TenantStats(2.0, 10, 4), NO_TENANT: TenantStats()}}

    metrics = env.app.platform.metrics
    snapshot = MetricsSnapshot(metrics)
    await snapshot.refresh()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    server = await MetricsServer.start(lambda: snapshot.text, sock)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        async with httpx.AsyncClient(base_url=base) as outsider:
            r = await outsider.get("/metrics")  # no credentials
    finally:
        await server.stop()
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert "vllm:num_requests_running" in families and "vllm:kv_cache_usage_perc" in families
    leaked = sorted(n for n in families if not n.startswith("vllm:"))
    assert leaked == [], f"the metrics port serves more than the protocol: {leaked}"
    labels = {name for f in families.values() for s in f.samples for name in s.labels}
    assert "tenant" not in labels

    # The main port still has everything, for the holder of a token.
    main = await env.http.get("/metrics", headers=env.admin_headers)
    assert main.status_code == 200
    assert "loraplex_requests_total" in main.text and "vllm:num_requests_running" in main.text
