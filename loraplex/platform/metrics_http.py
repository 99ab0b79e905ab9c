"""The metrics port's HTTP server: HTTP/1.1 with keep-alive, one route, written on asyncio's
``Protocol`` so that a scrape costs tens of microseconds of the API process's CPU, not a full
ASGI round (endpoint pickers scrape every pod 20 times a second, each).

What it answers (``metrics_response``): ``GET``/``HEAD /metrics`` (a query string is ignored)
the snapshot's text; another path 404; another method 405. It never reads a request body: a
request that announces one is answered and its connection closed, so body bytes are never read
as a request. Bounds, for whoever reaches the port: a request head of at most
``MAX_HEAD_BYTES`` (else 431 and close), ``MAX_CONNECTIONS`` open connections (more are closed
at once), and an idle connection closed after ``IDLE_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST

MAX_HEAD_BYTES = 8192
MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 60.0


def metrics_response(text: bytes, method: str, path: str) -> tuple[int, bytes, str]:
    """(status, body, content type) of one request; ``text``: the snapshot's exposition."""
    if path.split("?", 1)[0] != "/metrics":
        return 404, b"This port serves GET /metrics only.\n", "text/plain"
    if method not in ("GET", "HEAD"):
        return 405, b"Use GET /metrics.\n", "text/plain"
    return 200, text, CONTENT_TYPE_LATEST


def _encode(status: int, body: bytes, ctype: str, *, head_only: bool, close: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Content-Type: {ctype}",
             f"Content-Length: {len(body)}"]  # fmt: skip
    if status == 405:
        lines.append("Allow: GET, HEAD")
    if close:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


class MetricsProtocol(asyncio.Protocol):
    """One connection. ``text()`` gives the snapshot's current exposition text."""

    def __init__(self, text: Callable[[], bytes], open_connections: set[MetricsProtocol]) -> None:
        self._text = text
        self._open = open_connections
        self._buf = b""
        self._transport: asyncio.Transport | None = None
        self._idle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if len(self._open) >= MAX_CONNECTIONS:
            transport.close()
            return
        self._open.add(self)
        self._touch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._open.discard(self)
        if self._idle is not None:
            self._idle.cancel()

    def _touch(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = asyncio.get_running_loop().call_later(IDLE_TIMEOUT_S, self.close)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        self._touch()
        while self._transport is not None and not self._transport.is_closing():
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEAD_BYTES:
                    self._reply(431, b"The request head is too large.\n", "text/plain", close=True)
                return
            head, self._buf = self._buf[:end], self._buf[end + 4 :]
            if end > MAX_HEAD_BYTES:
                self._reply(431, b"The request head is too large.\n", "text/plain", close=True)
                return
            self._answer(head)

    def _answer(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._reply(400, b"Not an HTTP/1.x request.\n", "text/plain", close=True)
            return
        method, path, version = parts
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                self._reply(400, b"A malformed header line.\n", "text/plain", close=True)
                return
            headers[name.strip().lower()] = value.strip().lower()
        has_body = "transfer-encoding" in headers or headers.get("content-length", "0") != "0"
        keep = headers.get("connection", "keep-alive" if version == "HTTP/1.1" else "close")
        close = has_body or keep == "close"
        status, body, ctype = metrics_response(self._text(), method, path)
        self._reply(status, body, ctype, close=close, head_only=method == "HEAD")

    def _reply(
        self, status: int, body: bytes, ctype: str, *, close: bool, head_only: bool = False
    ) -> None:
        assert self._transport is not None
        self._transport.write(_encode(status, body, ctype, head_only=head_only, close=close))
        if close:
            self._transport.close()


class MetricsServer:
    """The metrics port while it serves (``start``) until ``stop`` closes it and every
    connection."""

    def __init__(self, server: asyncio.Server, connections: set[MetricsProtocol]) -> None:
        self._server = server
        self._connections = connections

    @classmethod
    async def start(cls, text: Callable[[], bytes], sock: socket.socket) -> MetricsServer:
        """Serve on the bound socket ``sock``; ``text()`` is read at every request."""
        connections: set[MetricsProtocol] = set()
        server = await asyncio.get_running_loop().create_server(
            lambda: MetricsProtocol(text, connections), sock=sock, start_serving=True
        )
        return cls(server, connections)

    async def stop(self) -> None:
        self._server.close()
        for conn in list(self._connections):
            conn.close()
        await self._server.wait_closed()
