"""Admin UI sessions across platform replicas: a sign-in on one replica is valid on the other
(same CSRF token, its flash message shown there), signing out on one ends it on both; the
database store keeps the memory store's expiry rules and stores only the id's hash."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from sqlalchemy import func, select

from loraplex.platform.db.models import AdminSession
from loraplex.webui.context import SESSION_COOKIE
from loraplex.webui.sessions import DatabaseSessionStore
from tests.utils.tenancy import TenancyEnv, platform_for
from tests.utils.web import csrf_of, sign_in

pytestmark = pytest.mark.anyio


async def test_a_session_made_on_one_replica_works_on_the_other_until_signed_out(
    replicas: list[TenancyEnv],
) -> None:
    a, b = replicas
    assert a.app.webui is not None and b.app.webui is not None
    store_a = a.app.webui.sessions
    assert isinstance(store_a, DatabaseSessionStore)
    assert (await sign_in(a.http)).status_code == 303
    cookie = a.http.cookies[SESSION_COOKIE]
    b.http.cookies.set(SESSION_COOKIE, cookie, path="/admin")
    await store_a.drain()  # the "Signed in." message is written a moment after the redirect
    page_b = await b.http.get("/admin")
    assert page_b.status_code == 200, page_b.text[:300]
    assert "Signed in." in page_b.text  # the message made on A, shown (once) on B
    store_b = b.app.webui.sessions
    assert isinstance(store_b, DatabaseSessionStore)
    await store_b.drain()
    page_a = await a.http.get("/admin")
    assert page_a.status_code == 200 and "Signed in." not in page_a.text
    assert csrf_of(page_a.text) == csrf_of(page_b.text)  # one session, one CSRF token

    out = await b.http.post("/admin/logout", data={"csrf_token": csrf_of(page_b.text)})
    assert out.status_code == 303
    for env in (a, b):
        env.http.cookies.set(SESSION_COOKIE, cookie, path="/admin")
        gone = await env.http.get("/admin")
        assert gone.status_code == 303 and "/admin/login" in gone.headers["location"]


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def test_database_sessions_expire_like_memory_ones_and_keep_only_hashes(
    tmp_path: Path,
) -> None:
    store = platform_for(tmp_path)
    try:
        clock = _Clock()
        sessions = DatabaseSessionStore(
            store.db, idle_timeout_s=600, max_age_s=3600, max_sessions=2, touch_s=60, clock=clock
        )
        other = DatabaseSessionStore(store.db, idle_timeout_s=600, max_age_s=3600, clock=clock)
        sid, session = await sessions.open("v1")
        with store.db.session() as db:
            (row,) = db.scalars(select(AdminSession))
            assert row.id_sha256 == hashlib.sha256(sid.encode()).hexdigest() != sid
        loaded = await other.load(sid)
        assert loaded is not None and loaded.csrf_token == session.csrf_token
        assert loaded.csrf_matches(session.csrf_token) and not loaded.csrf_matches("x")
        for _ in range(6):  # used every 9 minutes: never idle for 10
            clock.now += 540
            assert await other.load(sid) is not None
        clock.now += 601  # idle too long
        assert await sessions.load(sid) is None and await other.load(sid) is None

        old, _ = await sessions.open("v1")
        for _ in range(7):  # busy until its max_age (3600 s)
            clock.now += 500
            assert await sessions.load(old) is not None
        clock.now += 101  # past max_age, however busy
        assert await sessions.load(old) is None

        first, _ = await sessions.open("v1")
        clock.now += 1
        second, _ = await sessions.open("v1")
        clock.now += 1
        third, _ = await sessions.open("v1")  # max_sessions=2: the least recently used goes
        assert await sessions.load(first) is None
        assert await sessions.load(second) is not None and await sessions.load(third) is not None
        await sessions.end(second)
        assert await other.load(second) is None
        await other.end_all()
        assert await sessions.load(third) is None
        with store.db.session() as db:
            assert db.scalar(select(func.count()).select_from(AdminSession)) == 0
        assert await sessions.load(None) is None and await sessions.load("x" * 200) is None
    finally:
        store.db.dispose()
