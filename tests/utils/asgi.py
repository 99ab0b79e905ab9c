"""Driving the app over raw ASGI: ``drive_until_disconnect`` runs one request and disconnects
the client when a condition holds (what an HTTP client library cannot do mid-response)."""

from __future__ import annotations

import asyncio
import json
from typing import Any


def http_scope(
    path: str,
    extra_headers: tuple[tuple[bytes, bytes], ...] = (),
    content_type: bytes = b"application/json",
) -> dict[str, Any]:
    """The ASGI scope of a POST to ``path`` (JSON unless ``content_type`` says otherwise)."""
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
        "headers": [(b"content-type", content_type), (b"host", b"test"), *extra_headers],
        "client": ("127.0.0.1", 5000),
        "server": ("test", 80),
    }


async def drive_until_disconnect(
    app: Any,
    path: str,
    body: dict[str, Any] | bytes,
    leave_when: Any,
    extra_headers: tuple[tuple[bytes, bytes], ...] = (),
    content_type: bytes = b"application/json",
) -> list[dict[str, Any]]:
    """Runs one request through ``app`` (``body``: JSON, or the raw bytes of ``content_type``);
    the client disconnects once ``leave_when(sent)``."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    inbox = [{"type": "http.request", "body": raw, "more_body": False}]
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

    scope = http_scope(path, extra_headers, content_type)
    task = asyncio.ensure_future(app(scope, receive, send))
    for _ in range(2000):
        if leave_when(sent):
            break
        await asyncio.sleep(0.005)
    gone.set()
    await asyncio.wait_for(task, timeout=10)
    return sent
