"""Per-request bookkeeping at the ASGI level: one structured log line per API request, and the
request-body size limit.

``RequestLogMiddleware`` puts a ``RequestRecord`` in the request state before routing;
handlers fill in what they know (model, token counts, finish reasons). The line is written when
the response's last byte is sent, or when the client goes away mid-stream (status 499), so a
streaming request is logged with its final token counts. Then the middleware's observers see the
finished record (the metrics; usage rows hook in the same way).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.errors import APIError

logger = logging.getLogger("loraplex.platform.requests")

CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"


@dataclass
class RequestRecord:
    method: str
    path: str
    start: float = field(default_factory=time.perf_counter)
    request_id: str | None = None
    caller: str | None = None
    model: str | None = None  # as the caller sent it (logged, never a metric label)
    served_model: str | None = None  # what ``model`` resolved to; None when it did not resolve
    tenant_id: str | None = None
    key_id: str | None = None  # the public id of the tenant key used (usage rows)
    lora_key: str | None = None
    adapter_version_id: int | None = None  # the registry's AdapterVersion id (usage rows)
    user: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    stream: bool = False
    finish_reasons: list[str] = field(default_factory=list)
    status: int | None = None
    error_code: str | None = None
    stream_error_status: int | None = None  # the status of an error sent inside a stream
    # Filled when a generation ran (``generated``); times are time.perf_counter(), like start.
    generated: bool = False
    first_token_time: float | None = None
    time_per_output_token: float | None = None
    queue_time: float | None = None  # seconds in the engine's waiting queue

    def latency(self) -> float:
        """Seconds since the request arrived."""
        return time.perf_counter() - self.start

    def as_log(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "caller": self.caller,
            "model": self.model,
            "user": self.user,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reasons": self.finish_reasons or None,
            "error_code": self.error_code,
            "latency_ms": round(self.latency() * 1000, 1),
        }


def request_record(request: Request) -> RequestRecord:
    """The record of ``request`` (a fresh one where the middleware is not installed)."""
    record = getattr(request.state, "record", None)
    if not isinstance(record, RequestRecord):
        record = RequestRecord(request.method, request.url.path)
        request.state.record = record
    return record


RecordObserver = Callable[[RequestRecord], None]


class RequestLogMiddleware:
    """Logs one JSON line per HTTP request to ``loraplex.platform.requests`` (``quiet_paths``,
    exact, and ``quiet_prefixes`` at DEBUG, so probes, scrapers, the admin UI's polls and its
    static files do not flood the log), then hands the finished record to each of ``observers``
    (whose failures are logged, never raised)."""

    def __init__(
        self,
        app: ASGIApp,
        quiet_paths: tuple[str, ...] = (
            "/health",
            "/metrics",
            "/admin/overview.json",
            "/admin/overview/charts",
        ),
        observers: Sequence[RecordObserver] = (),
        quiet_prefixes: tuple[str, ...] = ("/admin/static/",),
    ) -> None:
        self.app = app
        self.quiet_paths = quiet_paths
        self.quiet_prefixes = quiet_prefixes
        self.observers = tuple(observers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(scope["method"], scope["path"])
        scope.setdefault("state", {})["record"] = record
        done = False

        async def send_logged(message: Message) -> None:
            nonlocal done
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True

        try:
            await self.app(scope, receive, send_logged)
        except BaseException:
            if record.status is None or record.status < 400:
                record.status = 500 if record.status is None else CLIENT_CLOSED
            raise
        finally:
            if not done and (record.status is None or record.status < 400):
                record.status = CLIENT_CLOSED
            path = scope["path"]
            quiet = path in self.quiet_paths or path.startswith(self.quiet_prefixes)
            level = logging.DEBUG if quiet else logging.INFO
            logger.log(level, json.dumps(record.as_log()))
            for observe in self.observers:
                try:
                    observe(record)
                except Exception:
                    logger.exception("a request observer failed on %s", scope["path"])


class BodyLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` with 413 in the API's error envelope.

    Reads the body ahead of the app (the API's bodies are small JSON documents) and replays it;
    after the body, ``receive`` passes through, so handlers still see ``http.disconnect``.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        exempt: Callable[[Scope], bool] = lambda scope: False,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt  # requests that stream and limit their own bodies (uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.exempt(scope):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # a disconnect: let the app see it
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replay: list[Message] = [message]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"The request body is larger than this server accepts ({self.max_bytes} bytes); "
            "send a shorter prompt or fewer messages.",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
