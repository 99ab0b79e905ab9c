"""Per-request bookkeeping at the ASGI level: one structured log line per API request, and the
request-body size limit.

``RequestLogMiddleware`` puts a ``RequestRecord`` in the request state before routing;
handlers fill in what they know (model, token counts, finish reasons). The line is written when
the response's last byte is sent, or when the client goes away mid-stream (status 499), so a
streaming request is logged with its final token counts. Then the middleware's observers see the
finished record (the metrics; usage rows hook in the same way).

For the stored request log (``loraplex.platform.request_logs``) the middleware also notes the
public id of a tenant key presented in ``Authorization`` (never its secret: a refused key's
tenant is then still known), gives every response under ``/v1/`` an ``x-request-id``, and keeps
the request and response bodies of ``BODY_PATHS`` when ``body_cap`` says the caller's tenant
opted in (decided when the response starts, the caller known by then; at most that many bytes
of each, at most ``MAX_BODY_CAPTURE``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.errors import APIError
from loraplex.platform.keys import parse_key

logger = logging.getLogger("loraplex.platform.requests")

CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection first"
LOGGED_PREFIX = "/v1/"  # the tenant-facing API: these responses carry x-request-id
BODY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MAX_BODY_CAPTURE = 1024 * 1024  # the most of each body ever kept, whatever a tenant's cap


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
    # The request log: the public id of a well-formed tenant key in Authorization (also when
    # the key was refused), and the bodies where the tenant opted in (cut at its cap).
    presented_key: str | None = None
    request_body: bytes | None = None
    response_body: bytes | None = None

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
# How many bytes of each body to keep for ``record``'s tenant; None: none (the default).
BodyCap = Callable[[RequestRecord], int | None]


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
        body_cap: BodyCap | None = None,
    ) -> None:
        self.app = app
        self.quiet_paths = quiet_paths
        self.quiet_prefixes = quiet_prefixes
        self.observers = tuple(observers)
        self.body_cap = body_cap

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(scope["method"], scope["path"])
        scope.setdefault("state", {})["record"] = record
        logged = scope["path"].startswith(LOGGED_PREFIX)
        if logged:
            record.presented_key = _presented_key(scope)
        capture = (
            _BodyCapture() if self.body_cap is not None and scope["path"] in BODY_PATHS else None
        )
        done = False

        async def receive_logged() -> Message:
            message = await receive()
            if capture is not None and message["type"] == "http.request":
                capture.add_request(message.get("body", b""))
            return message

        async def send_logged(message: Message) -> None:
            nonlocal done, capture
            if message["type"] == "http.response.start":
                record.status = message["status"]
                if logged:
                    message = _with_request_id(message, record)
                if capture is not None and not capture.start(self.body_cap, record):
                    capture = None  # the tenant did not opt in: drop what was kept
            elif capture is not None and message["type"] == "http.response.body":
                capture.add_response(message.get("body", b""))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True

        try:
            await self.app(scope, receive_logged if capture is not None else receive, send_logged)
        except BaseException:
            if record.status is None or record.status < 400:
                record.status = 500 if record.status is None else CLIENT_CLOSED
            raise
        finally:
            if not done and (record.status is None or record.status < 400):
                record.status = CLIENT_CLOSED
            if capture is not None:
                capture.finish(record)
            path = scope["path"]
            quiet = path in self.quiet_paths or path.startswith(self.quiet_prefixes)
            level = logging.DEBUG if quiet else logging.INFO
            logger.log(level, json.dumps(record.as_log()))
            for observe in self.observers:
                try:
                    observe(record)
                except Exception:
                    logger.exception("a request observer failed on %s", scope["path"])


def _presented_key(scope: Scope) -> str | None:
    """The public id of a well-formed tenant key in ``Authorization: Bearer``, else None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            parsed = parse_key(token.strip()) if scheme.lower() == "bearer" else None
            return parsed[0] if parsed is not None else None
    return None


def _with_request_id(message: Message, record: RequestRecord) -> Message:
    """``message`` (a response start) with ``x-request-id``: the handler's id (``chatcmpl-...``)
    or one made now for a request refused before it had one."""
    if record.request_id is None:
        record.request_id = f"req-{uuid.uuid4().hex}"
    headers = list(message.get("headers", ()))
    if not any(name.lower() == b"x-request-id" for name, _ in headers):
        headers.append((b"x-request-id", record.request_id.encode("latin-1", "replace")))
    return {**message, "headers": headers}


class _BodyCapture:
    """Up to ``MAX_BODY_CAPTURE`` bytes of the request body (references to the received chunks,
    no copy) until the response starts; then, for an opted-in tenant, up to its cap of each."""

    def __init__(self) -> None:
        self.request: list[bytes] = []
        self.request_size = 0
        self.response = bytearray()
        self.cap = 0

    def add_request(self, chunk: bytes) -> None:
        if chunk and self.request_size < MAX_BODY_CAPTURE:
            self.request.append(chunk)
            self.request_size += len(chunk)

    def start(self, body_cap: BodyCap | None, record: RequestRecord) -> bool:
        cap = body_cap(record) if body_cap is not None else None
        if cap is None or cap <= 0:
            return False
        self.cap = min(cap, MAX_BODY_CAPTURE)
        return True

    def add_response(self, chunk: bytes) -> None:
        room = self.cap - len(self.response)
        if room > 0 and chunk:
            self.response += chunk[:room]

    def finish(self, record: RequestRecord) -> None:
        if self.cap <= 0:
            return
        record.request_body = b"".join(self.request)[: self.cap]
        record.response_body = bytes(self.response)


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
