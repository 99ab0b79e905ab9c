"""``loraplex serve --metrics-port PORT``: a second HTTP server, in the server's event loop, that
answers ``GET /metrics`` from a snapshot without credentials (``platform/metrics_port.py``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
from collections.abc import Iterator

from loraplex.platform.metrics import PlatformMetrics
from loraplex.platform.metrics_port import MetricsSnapshot, metrics_app


class MetricsPort:
    """The metrics port while it serves: ``start`` binds it (an ``OSError`` that names the flag
    when it cannot), takes the first snapshot and starts serving; ``stop`` ends both."""

    def __init__(self, snapshot: MetricsSnapshot, sock: socket.socket, log_level: str) -> None:
        import uvicorn

        class Quiet(uvicorn.Server):  # the main server handles SIGTERM / SIGINT
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        config = uvicorn.Config(
            metrics_app(snapshot), lifespan="off", access_log=False, log_level=log_level
        )
        self.snapshot = snapshot
        self._server = Quiet(config)
        self._tasks = [
            asyncio.create_task(snapshot.run(), name="metrics-snapshot"),
            asyncio.create_task(self._server.serve(sockets=[sock]), name="metrics-port"),
        ]

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
        # Accepted connections inherit it: a response goes out as two writes (head, body), and
        # with Nagle's algorithm on, the body of a small one waits for the client's delayed
        # ACK (40 ms a scrape; 0.5 ms with it, scripts/metrics_scrape_bench.py)
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
        warning = "warning" if args.log_level in ("debug", "info") else args.log_level
        return cls(snapshot, sock, warning)

    async def stop(self) -> None:
        self._server.should_exit = True
        snapshot, serving = self._tasks
        snapshot.cancel()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(serving), 5.0)
        serving.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
