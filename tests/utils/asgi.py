"""Driving the app over raw ASGI: ``drive_until_disconnect`` runs one request and disconnects
the client when a condition holds (what an HTTP client library cannot do mid-response)."""

from __future__ import annotations

import asyncio
import json
from typing import Any


def http_scope(path: str, extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> dict[str, Any]:
    """The ASGI scope of a JSON POST to ``path``."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test"), *extra_headers],
        "client": ("127.0.0.1", 5000),
        "server": ("test", 80),
    }


async def drive_until_disconnect(
    app: Any,
    path: str,
    body: dict[str, Any],
    leave_when: Any,
    extra_headers: tuple[tuple[bytes, bytes], ...] = (),
) -> list[dict[str, Any]]:
    """Runs one request through ``app``; the client disconnects once ``leave_when()``."""
    inbox = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set():
            raise OSError("the client is gone")
        sent.append(message)

    task = asyncio.ensure_future(app(http_scope(path, extra_headers), receive, send))
    for _ in range(2000):
        if leave_when(sent):
            break
        await asyncio.sleep(0.005)
    gone.set()
    await asyncio.wait_for(task, timeout=10)
    return sent
