"""The metrics port's HTTP server (``platform/metrics_http.py``) on a real socket, as scrapers
and strangers reach it: keep-alive scrapes, HEAD, 404/405, pipelined requests, a request with a
body, an oversized head, garbage, the connection bound, and stop closing open connections."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import httpx
import pytest

from loraplex.platform import metrics_http
from loraplex.platform.metrics_http import MetricsServer

pytestmark = pytest.mark.anyio

TEXT = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3.0\n"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def port() -> AsyncIterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    server = await MetricsServer.start(lambda: TEXT, sock)
    try:
        yield sock.getsockname()[1]
    finally:
        await server.stop()


async def raw(port: int, data: bytes, *, read_until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        if read_until_close:
            return await asyncio.wait_for(reader.read(), 5)
        return await asyncio.wait_for(reader.read(65536), 5)
    finally:
        writer.close()


async def test_scrapes_keep_their_connection_and_get_the_snapshot(port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        for _ in range(5):
            r = await client.get("/metrics")
            assert r.status_code == 200 and r.content == TEXT
            assert r.headers["content-type"].startswith("text/plain; version=")
        r = await client.get("/metrics?name[]=x")  # a query string is ignored
        assert r.status_code == 200
        head = await client.head("/metrics")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(TEXT))


async def test_nothing_else_is_served(port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        r = await client.get("/v1/models")
        assert r.status_code == 404 and "GET /metrics only" in r.text
        r = await client.post("/metrics", json={"x": 1})
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
        r = await client.get("/metrics")  # a new connection: the body's bytes were never parsed
        assert r.status_code == 200


async def test_pipelined_requests_are_answered_in_order(port: int) -> None:
    req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    last = b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    out = await raw(port, req + req + last)
    assert out.count(b"HTTP/1.1 200 OK") == 2 and out.rstrip().endswith(b"only.")
    assert out.index(b"404 Not Found") > out.rindex(b"200 OK")


async def test_a_body_closes_the_connection_so_its_bytes_are_never_a_request(port: int) -> None:
    smuggled = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    req = b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(smuggled)
    out = await raw(port, req + smuggled)
    assert out.startswith(b"HTTP/1.1 405") and b"Connection: close" in out
    assert b"200 OK" not in out


@pytest.mark.parametrize(
    "data, status",
    [
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", b"431"),
        (b"A" * 9000, b"431"),  # no end of head at all
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", b"400"),  # a TLS hello
        (b"GET /metrics\r\n\r\n", b"400"),  # HTTP/0.9
        (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
    ],
)
async def test_malformed_and_oversized_requests_get_a_status_and_a_close(
    port: int, data: bytes, status: bytes
) -> None:
    out = await raw(port, data)
    assert out.startswith(b"HTTP/1.1 " + status) and b"Connection: close" in out


async def test_connections_are_bounded_and_stop_closes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 2)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    server = await MetricsServer.start(lambda: TEXT, sock)
    port = sock.getsockname()[1]
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    await asyncio.sleep(0.05)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the third is closed at once
    writer.close()
    await server.stop()
    for r, w in held:
        assert await asyncio.wait_for(r.read(), 5) == b""  # stop closed them
        w.close()
