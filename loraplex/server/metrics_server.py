"""``loraplex serve --metrics-port PORT``: a second HTTP server, in the server's event loop, that
answers ``GET /metrics`` from a snapshot without credentials (``platform/metrics_port.py``,
served by ``platform/metrics_http.py``)."""

from __future__ import annotations

import argparse
import asyncio
import socket

from loraplex.platform.metrics import PlatformMetrics
from loraplex.platform.metrics_http import MetricsServer
from loraplex.platform.metrics_port import MetricsSnapshot


class MetricsPort:
    """The metrics port while it serves: ``start`` binds it (an ``OSError`` that names the flag
    when it cannot), takes the first snapshot and starts serving; ``stop`` ends both."""

    def __init__(self, snapshot: MetricsSnapshot, server: MetricsServer) -> None:
        self.snapshot = snapshot
        self._server = server
        self._refresh = asyncio.create_task(snapshot.run(), name="metrics-snapshot")

    @classmethod
    async def start(cls, args: argparse.Namespace, metrics: PlatformMetrics) -> MetricsPort | None:
        """The port ``args.metrics_port`` names on ``args.host`` (None: no such flag)."""
        port: int | None = getattr(args, "metrics_port", None)
        if port is None:
            return None
        if port == args.port:
            raise ValueError(
                f"--metrics-port {port} is the API's --port; give the metrics their own port"
            )
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: a small response is never held back waiting for the
        # client's delayed ACK (Nagle's algorithm)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((args.host, port))
        except OSError as exc:
            sock.close()
            raise OSError(
                f"--metrics-port {port}: cannot listen on {args.host}:{port} ({exc.strerror}); "
                "choose a free port"
            ) from None
        snapshot = MetricsSnapshot(metrics)
        await snapshot.refresh()  # the first scrape already has numbers
        sock.listen(128)
        sock.setblocking(False)
        return cls(snapshot, await MetricsServer.start(lambda: snapshot.text, sock))

    async def stop(self) -> None:
        self._refresh.cancel()
        await asyncio.gather(self._refresh, return_exceptions=True)
        await self._server.stop()
