"""One webhook POST over asyncio streams (HTTP/1.1, ``Connection: close``; TLS for https).

The whole attempt (name lookup, connect, TLS, send, the receiver's status line and headers) has
one deadline, so a receiver that accepts and never answers costs one task for ``timeout``
seconds and nothing else: no thread, no request of the platform's waits on it. Only the status
is read; redirects are never followed (a 3xx is a failed attempt naming its Location).
URLs are checked when a subscription is made (``check_url``): http(s), a host, no credentials,
no whitespace or control characters (nothing that could reach the request head).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_URL = 2000
MAX_HEAD_LINES = 100


@dataclass(frozen=True)
class Outcome:
    """An attempt's result: ``status`` the receiver's HTTP status (None: no answer)."""

    status: int | None
    error: str | None  # None: a 2xx
    duration_ms: float

    @property
    def ok(self) -> bool:
        return self.error is None


def check_url(url: str) -> str | None:
    """Why ``url`` cannot receive webhooks (for people), or None."""
    if len(url) > MAX_URL:
        return f"the URL is longer than {MAX_URL} characters"
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        return "the URL has spaces or control characters; percent-encode them"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        return f"the URL is not valid ({exc})"
    if parts.scheme not in ("http", "https"):
        return "only http:// and https:// URLs receive webhooks"
    if not parts.hostname:
        return "the URL has no host"
    if parts.username is not None or parts.password is not None:
        return "the URL carries credentials; leave them out (the signature authenticates us)"
    if parts.fragment:
        return "the URL has a fragment (#...); leave it out"
    return None


async def post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> Outcome:
    """POST ``body`` to ``url`` (checked by ``check_url``) within ``timeout`` seconds."""
    start = time.perf_counter()
    try:
        status, location = await asyncio.wait_for(_exchange(url, body, headers), timeout)
    except asyncio.TimeoutError:
        return _failed(start, f"no answer within {timeout:g} s")
    except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
        return _failed(start, f"{type(exc).__name__}: {exc}"[:300])
    error: str | None = None
    if 300 <= status < 400:
        error = f"HTTP {status}: redirects are not followed (Location: {location[:200]})"
    elif not 200 <= status < 300:
        error = f"HTTP {status}"
    return Outcome(status, error, _ms_since(start))


def _ms_since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 1)


def _failed(start: float, error: str) -> Outcome:
    return Outcome(None, error, _ms_since(start))


async def _exchange(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    parts = urlsplit(url)
    https = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if https else 80)
    context = ssl.create_default_context() if https else None
    reader, writer = await asyncio.open_connection(
        host, port, ssl=context, server_hostname=host if https else None
    )
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        authority = parts.netloc  # no credentials (check_url)
        head = [f"POST {target} HTTP/1.1", f"Host: {authority}", "Connection: close",
                f"Content-Length: {len(body)}"]  # fmt: skip
        head += [f"{name}: {value}" for name, value in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        status_line = (await reader.readline()).decode("latin-1").split(" ", 2)
        # A status is 3 ASCII digits (RFC 9110 15): int() alone took '+200', '2_00' and any
        # number of digits, one the delivery's integer column could not hold.
        if (
            len(status_line) < 2
            or not status_line[0].startswith("HTTP/")
            or not (len(code := status_line[1].strip()) == 3 and code.isascii() and code.isdigit())
        ):
            raise ValueError("the receiver did not answer HTTP")
        status = int(code)
        location = ""
        for _ in range(MAX_HEAD_LINES):
            line = (await reader.readline()).decode("latin-1").strip()
            if not line:
                break
            name, _, value = line.partition(":")
            if name.strip().lower() == "location":  # for people, in a text column: printable
                location = "".join(c for c in value.strip()[:200] if c.isprintable())
        return status, location
    finally:
        writer.close()
