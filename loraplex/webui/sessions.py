"""Admin sessions, their CSRF tokens, and login throttling — all in this process's memory.

Why memory and not the database: a session is touched on every page view and every live-refresh
poll (every two seconds per open tab); keeping that off the database keeps SQLite's single writer
free for the platform's real work. The price: a restart signs operators out (they sign in again
with the same admin token), and several platform replicas need sticky sessions at the proxy. The
store is one small class, so a database-backed one can replace it without touching the routes.

Invariants:

* the cookie carries a random 256-bit id; the store keys sessions by the id's SHA-256, so the
  ids themselves are never kept and a lookup does not compare secrets byte by byte;
* a session expires after ``idle_timeout_s`` without a request and ``max_age_s`` after sign-in,
  whichever comes first; at most ``max_sessions`` live at once (the least recently used go first);
* each session has its own CSRF token, fixed for its life, checked in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

FlashLevel = Literal["info", "success", "error"]

Clock = Callable[[], float]


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class Session:
    csrf_token: str
    created: float
    last_seen: float
    credential_version: str  # of the admin token it signed in with (see credentials.py)
    verified_at: float  # when credential_version was last found current
    flashes: list[tuple[FlashLevel, str]] = field(default_factory=list)

    def csrf_matches(self, candidate: str | None) -> bool:
        if not candidate:
            return False
        return hmac.compare_digest(
            candidate.encode("utf-8", "surrogatepass"), self.csrf_token.encode()
        )

    def flash(self, level: FlashLevel, message: str) -> None:
        """A message for the next page this session sees (then dropped)."""
        self.flashes.append((level, message))
        del self.flashes[:-10]  # a bounded queue: a loop of failed posts cannot grow it

    def pop_flashes(self) -> list[tuple[FlashLevel, str]]:
        out, self.flashes = self.flashes, []
        return out


class SessionStore:
    def __init__(
        self,
        *,
        idle_timeout_s: float = 8 * 3600,
        max_age_s: float = 24 * 3600,
        max_sessions: int = 1000,
        clock: Clock = time.monotonic,
    ) -> None:
        if idle_timeout_s <= 0 or max_age_s <= 0 or max_sessions < 1:
            raise ValueError("session timeouts must be positive and max_sessions at least 1")
        self.idle_timeout_s = idle_timeout_s
        self.max_age_s = max_age_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._sessions)

    def now(self) -> float:
        return self._clock()

    def create(self, credential_version: str) -> tuple[str, Session]:
        """A new session: returns the id for the cookie (shown only here) and the session."""
        now = self._clock()
        session_id = secrets.token_urlsafe(32)
        session = Session(
            csrf_token=secrets.token_urlsafe(32),
            created=now,
            last_seen=now,
            credential_version=credential_version,
            verified_at=now,
        )
        self._sessions[_digest(session_id)] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        """The live session of ``session_id`` (touched), or None when unknown or expired."""
        if not session_id or len(session_id) > 128:
            return None
        key = _digest(session_id)
        session = self._sessions.get(key)
        if session is None:
            return None
        now = self._clock()
        if now - session.last_seen > self.idle_timeout_s or now - session.created > self.max_age_s:
            del self._sessions[key]
            return None
        session.last_seen = now
        self._sessions.move_to_end(key)
        return session

    def delete(self, session_id: str | None) -> None:
        if session_id:
            self._sessions.pop(_digest(session_id), None)

    def clear(self) -> None:
        """Sign everyone out (for example after the admin token changed)."""
        self._sessions.clear()


class LoginThrottle:
    """At most ``max_failures`` failed sign-ins per client within ``window_s`` seconds; after that
    the client waits until the oldest of those failures leaves the window. A successful sign-in
    clears the client's record. At most ``max_clients`` clients are tracked (oldest dropped)."""

    def __init__(
        self,
        *,
        max_failures: int = 5,
        window_s: float = 300.0,
        max_clients: int = 10_000,
        clock: Clock = time.monotonic,
    ) -> None:
        if max_failures < 1 or window_s <= 0 or max_clients < 1:
            raise ValueError("max_failures, window_s and max_clients must be positive")
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_clients = max_clients
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, client: str) -> deque[float] | None:
        times = self._failures.get(client)
        if times is None:
            return None
        horizon = self._clock() - self.window_s
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            del self._failures[client]
            return None
        return times

    def retry_after(self, client: str) -> int:
        """Seconds ``client`` must wait before trying again; 0 when it may try now."""
        times = self._recent(client)
        if times is None or len(times) < self.max_failures:
            return 0
        wait = times[-self.max_failures] + self.window_s - self._clock()
        return max(1, math.ceil(wait))

    def failed(self, client: str) -> None:
        times = self._recent(client)
        if times is None:
            times = self._failures[client] = deque(maxlen=self.max_failures)
        times.append(self._clock())
        self._failures.move_to_end(client)
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)


class OneTimeSecrets:
    """Tokens of just-created keys, each readable once, by the session that created it, within
    ``ttl_s``; at most ``max_items`` are kept (the oldest go first)."""

    def __init__(
        self,
        *,
        ttl_s: float = 600.0,
        max_items: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_items = max_items
        self._clock = clock
        self._items: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    @staticmethod
    def owner(session: Session) -> str:
        # The session's CSRF token is fixed for its life and never leaves it: a stable handle.
        return hashlib.sha256(session.csrf_token.encode()).hexdigest()

    def put(self, session: Session, public_id: str, token: str) -> None:
        self._items[(self.owner(session), public_id)] = (token, self._clock() + self.ttl_s)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def take(self, session: Session, public_id: str) -> str | None:
        item = self._items.pop((self.owner(session), public_id), None)
        if item is None or item[1] < self._clock():
            return None
        return item[0]
