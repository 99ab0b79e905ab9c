"""A real HTTP server that receives webhooks, in a thread, on a free port (tests, scripts).

``plan``: what the next requests get, one item each (an HTTP status, or ``HANG``: no answer until
the receiver stops); afterwards every request gets ``default``. ``received`` lists each request
(headers, body) in arrival order.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HANG = "hang"


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


class Receiver:
    def __init__(self, plan: list[int | str] | None = None, default: int | str = 200) -> None:
        self.plan = list(plan or [])
        self.default = default
        self.received: list[Received] = []
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.received.append(
                        Received(self.path, dict(self.headers.items()), body, time.time())
                    )
                    action = receiver.plan.pop(0) if receiver.plan else receiver.default
                if action == HANG:
                    receiver.stopping.wait(120)
                    return
                self.send_response(int(action))
                if 300 <= int(action) < 400:
                    self.send_header("Location", "http://elsewhere.invalid/hook")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # the default 5 refuses a burst of parallel deliveries

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()

    async def wait_for(self, count: int, timeout: float = 10.0) -> list[Received]:
        """The first ``count`` requests, once they arrived (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while len(self.received) < count:
            assert time.monotonic() < deadline, f"{len(self.received)} of {count} arrived"
            await asyncio.sleep(0.02)
        return self.received[:count]
