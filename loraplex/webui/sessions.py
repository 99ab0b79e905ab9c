"""Admin sessions, their CSRF tokens, and login throttling.

Two session stores with one async interface (``SessionBackend``: ``load``, ``open``, ``end``,
``end_all``), which the routes use:

* ``SessionStore`` keeps sessions in this process's memory (one server, the SQLite default): a
  session is touched on every page view and every live-refresh poll (every two seconds per open
  tab), and keeping that off the database keeps SQLite's single writer free for the platform's
  real work. A restart signs operators out (they sign in again with the same admin token).
* ``DatabaseSessionStore`` keeps them in the ``admin_sessions`` table, so a session made on one
  platform replica is valid on every replica on that database, and signing out on one ends it
  on all (``--shared-state database``). It writes ``last_seen`` at most every ``touch_s``
  seconds (so the idle timeout is exact to that), and flash messages as they are added or shown.

Invariants (both stores):

* the cookie carries a random 256-bit id; the store keys sessions by the id's SHA-256, so the
  ids themselves are never kept and a lookup does not compare secrets byte by byte;
* a session expires after ``idle_timeout_s`` without a request and ``max_age_s`` after sign-in,
  whichever comes first; at most ``max_sessions`` live at once (the least recently used go first);
* each session has its own CSRF token, fixed for its life, checked in constant time.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from sqlalchemy import delete, or_, select, update
from sqlalchemy.orm import Session as DBSession

from loraplex.platform.db.database import Database
from loraplex.platform.db.models import AdminSession
from loraplex.webui.credentials import SSOIdentity, sso_identity

logger = logging.getLogger(__name__)

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
    # Told when ``flashes`` change (the database store saves them); None: memory only.
    on_change: Callable[[Session], None] | None = field(default=None, repr=False, compare=False)

    @property
    def sso(self) -> SSOIdentity | None:
        """Who signed in through single sign-on (role, user); None: the admin token."""
        return sso_identity(self.credential_version)

    @property
    def read_only(self) -> bool:
        """The viewer role: pages only, no writes (an admin token session is an operator)."""
        identity = self.sso
        return identity is not None and identity.role == "viewer"

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
        if self.on_change is not None:
            self.on_change(self)

    def pop_flashes(self) -> list[tuple[FlashLevel, str]]:
        out, self.flashes = self.flashes, []
        if out and self.on_change is not None:
            self.on_change(self)
        return out


class SessionBackend(Protocol):
    """What the routes use of a session store (both stores implement it)."""

    def now(self) -> float: ...

    async def load(self, session_id: str | None) -> Session | None:
        """The live session of ``session_id`` (touched), or None when unknown or expired."""
        ...

    async def open(self, credential_version: str) -> tuple[str, Session]:
        """A new session: the id for the cookie (shown only here) and the session."""
        ...

    async def end(self, session_id: str | None) -> None: ...

    async def end_all(self) -> None:
        """Sign everyone out (for example after the admin token changed)."""
        ...


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

    # ---- SessionBackend: the same, for the routes (nothing here waits) -----------------------

    async def load(self, session_id: str | None) -> Session | None:
        return self.get(session_id)

    async def open(self, credential_version: str) -> tuple[str, Session]:
        return self.create(credential_version)

    async def end(self, session_id: str | None) -> None:
        self.delete(session_id)

    async def end_all(self) -> None:
        self.clear()


class DatabaseSessionStore:
    """Sessions in the ``admin_sessions`` table, shared by every replica on ``db`` (see the
    module docstring). ``clock``: epoch seconds (replicas' clocks must agree; tests fake it).
    Each replica keeps its own ``verified_at`` (when it last checked the admin token) in the
    session objects it caches; everything else is read from the row on every ``load``."""

    def __init__(
        self,
        db: Database,
        *,
        idle_timeout_s: float = 8 * 3600,
        max_age_s: float = 24 * 3600,
        max_sessions: int = 1000,
        touch_s: float = 60.0,
        clock: Clock = time.time,
    ) -> None:
        if idle_timeout_s <= 0 or max_age_s <= 0 or max_sessions < 1:
            raise ValueError("session timeouts must be positive and max_sessions at least 1")
        self.db = db
        self.idle_timeout_s = idle_timeout_s
        self.max_age_s = max_age_s
        self.max_sessions = max_sessions
        self.touch_s = min(touch_s, idle_timeout_s / 10)
        self._clock = clock
        self._cache: OrderedDict[str, Session] = OrderedDict()  # this replica's views, LRU
        self._pending: dict[str, asyncio.Task[None]] = {}  # a session's newest flash write

    def now(self) -> float:
        return self._clock()

    def _expired(self, now: float, created: float, last_seen: float) -> bool:
        return now - last_seen > self.idle_timeout_s or now - created > self.max_age_s

    async def load(self, session_id: str | None) -> Session | None:
        if not session_id or len(session_id) > 128:
            return None
        key = _digest(session_id)
        pending = self._pending.get(key)
        if pending is not None:  # this replica's own flash writes land first
            await asyncio.wait({pending})
        now = self._clock()

        def read(db: DBSession) -> AdminSession | None:
            row = db.get(AdminSession, key)
            if row is None:
                return None
            if self._expired(now, row.created, row.last_seen):
                db.delete(row)
                return None
            if now - row.last_seen >= self.touch_s:
                row.last_seen = now
            return row

        row = await self.db.run(read)
        if row is None:
            self._cache.pop(key, None)
            return None
        session = self._cache.get(key)
        if session is None or session.csrf_token != row.csrf_token:
            session = Session(
                csrf_token=row.csrf_token,
                created=row.created,
                last_seen=row.last_seen,
                credential_version=row.credential_version,
                verified_at=-math.inf,  # this replica checks the admin token first
                on_change=lambda changed: self._save_flashes(key, changed),
            )
            self._cache[key] = session
            while len(self._cache) > self.max_sessions:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        session.last_seen = row.last_seen
        session.flashes = [(level, text) for level, text in row.flashes]  # type: ignore[misc]
        return session

    async def open(self, credential_version: str) -> tuple[str, Session]:
        now = self._clock()
        session_id = secrets.token_urlsafe(32)
        key = _digest(session_id)
        csrf = secrets.token_urlsafe(32)

        def insert(db: DBSession) -> None:
            # Expired sessions go, then the least recently used beyond max_sessions.
            db.execute(
                delete(AdminSession).where(
                    or_(
                        AdminSession.last_seen < now - self.idle_timeout_s,
                        AdminSession.created < now - self.max_age_s,
                    )
                )
            )
            db.add(
                AdminSession(
                    id_sha256=key,
                    csrf_token=csrf,
                    credential_version=credential_version,
                    created=now,
                    last_seen=now,
                    flashes=[],
                )
            )
            db.flush()
            keep = (
                select(AdminSession.id_sha256)
                .order_by(AdminSession.last_seen.desc(), AdminSession.created.desc())
                .limit(self.max_sessions)
            )
            db.execute(delete(AdminSession).where(AdminSession.id_sha256.not_in(keep)))

        await self.db.run(insert)
        session = Session(
            csrf_token=csrf,
            created=now,
            last_seen=now,
            credential_version=credential_version,
            verified_at=now,
            on_change=lambda changed: self._save_flashes(key, changed),
        )
        self._cache[key] = session
        return session_id, session

    async def end(self, session_id: str | None) -> None:
        if not session_id or len(session_id) > 128:
            return
        key = _digest(session_id)
        self._cache.pop(key, None)
        await self.db.run(
            lambda db: db.execute(delete(AdminSession).where(AdminSession.id_sha256 == key))
        )

    async def end_all(self) -> None:
        self._cache.clear()
        await self.db.run(lambda db: db.execute(delete(AdminSession)))

    def _save_flashes(self, key: str, session: Session) -> None:
        """Write the session's flashes (called from the event loop, which must not wait):
        a task per change, each after the one before (per session); ``load`` on this replica
        waits for them, another replica sees them once written (milliseconds)."""
        flashes = [[level, text] for level, text in session.flashes]
        previous = self._pending.get(key)

        def save(db: DBSession) -> None:
            db.execute(
                update(AdminSession).where(AdminSession.id_sha256 == key).values(flashes=flashes)
            )

        async def write() -> None:
            if previous is not None:
                await asyncio.wait({previous})
            try:
                await self.db.run(save)
            except Exception:  # a message lost, nothing else: the session is intact
                logger.exception("saving an admin session's messages failed")

        task = asyncio.get_running_loop().create_task(write())
        self._pending[key] = task
        task.add_done_callback(lambda done: self._written(key, done))

    def _written(self, key: str, task: asyncio.Task[None]) -> None:
        if self._pending.get(key) is task:
            del self._pending[key]

    async def drain(self) -> None:
        """Wait until every message write started so far is in the database (tests)."""
        while self._pending:
            await asyncio.gather(*self._pending.values(), return_exceptions=True)


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
