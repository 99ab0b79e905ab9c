"""Signatures of webhook deliveries, as Stripe signs its own.

Each delivery carries ``X-Loraplex-Signature: t=<unix seconds>,v1=<hex>`` where ``hex`` is
HMAC-SHA256, keyed with the subscription's secret (its UTF-8 bytes), of ``<t>.<body>`` (the raw
request body bytes, unchanged). A receiver recomputes it over the body as received, compares in
constant time, and refuses a ``t`` too far from its own clock (a replay): ``verify`` does all of
it, and needs only the standard library, so a receiver can copy it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

HEADER = "X-Loraplex-Signature"
SECRET_PREFIX = "whsec_"
TOLERANCE_S = 300


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def signature(secret: str, timestamp: int, body: bytes) -> str:
    message = str(timestamp).encode() + b"." + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The header's value for ``body`` sent at ``timestamp`` (default: now)."""
    t = int(time.time()) if timestamp is None else timestamp
    return f"t={t},v1={signature(secret, t, body)}"


def verify(
    secret: str, header: str, body: bytes, *, tolerance_s: float = TOLERANCE_S,
    now: float | None = None,
) -> bool:  # fmt: skip
    """Whether ``header`` signs ``body`` with ``secret`` within ``tolerance_s`` of ``now``."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        t = int(parts["t"])
    except (KeyError, ValueError):
        return False
    current = time.time() if now is None else now
    if abs(current - t) > tolerance_s:
        return False
    return hmac.compare_digest(parts.get("v1", ""), signature(secret, t, body))
