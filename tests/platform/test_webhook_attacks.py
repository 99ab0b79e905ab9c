"""Alert webhooks against receivers that misbehave on purpose (the receiver is a third party's
server): a status line whose code is no HTTP status (20 digits) is a failed attempt like any
garbage answer, recorded and retried within the attempt limit; it never reaches the database as
a number its integer column cannot hold (the outcome was then never recorded, and the delivery
was claimed again after every lease, forever). A redirect's ``Location`` is recorded without its
control characters (PostgreSQL refuses a NUL in text: the same endless retries)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.utils.fakes import FakeEngineClient
from tests.utils.tenancy import TenancyEnv, tenancy_env

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def fast_webhooks(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"POLL_S": "0.05", "RETRY_BASE_S": "0.1", "TIMEOUT_S": "1",
                        "MAX_ATTEMPTS": "3"}.items():  # fmt: skip
        monkeypatch.setenv(f"LORAPLEX_WEBHOOK_{name}", value)


@pytest.fixture
async def env(
    tmp_path: Path, fake: FakeEngineClient, tokenizer: Any, database_url: str | None
) -> AsyncIterator[TenancyEnv]:
    async with (
        tenancy_env(tmp_path, fake, tokenizer, database_url=database_url) as env,
        env.app.platform.lifespan(own_client=False),
    ):
        yield env


@pytest.mark.parametrize("status", [b"99999999999999999999", b"2147483648", b"2_00", b"+200"])
async def test_a_status_code_that_is_no_http_status_is_a_failed_attempt(
    env: TenancyEnv, status: bytes
) -> None:
    answered: list[bytes] = []

    async def receiver(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 " + status + b" Odd\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(receiver, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        delivery = await _test_send(env, f"http://127.0.0.1:{port}/hook")
    finally:
        server.close()
    assert delivery["state"] == "failed", delivery
    assert delivery["attempts"] == 3 and len(answered) == 3
    assert delivery["last_status"] is None
    assert "did not answer HTTP" in delivery["last_error"]


async def test_a_redirect_to_a_location_with_control_characters_is_recorded(
    env: TenancyEnv,
) -> None:
    async def receiver(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 302 Found\r\nLocation: http://x.invalid/a\x00b\x1bc\r\n"
                     b"Content-Length: 0\r\n\r\n")  # fmt: skip
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(receiver, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        delivery = await _test_send(env, f"http://127.0.0.1:{port}/hook")
    finally:
        server.close()
    assert delivery["state"] == "failed" and delivery["attempts"] == 3, delivery
    assert delivery["last_status"] == 302
    assert "(Location: http://x.invalid/abc)" in delivery["last_error"]


async def _test_send(env: TenancyEnv, url: str) -> dict[str, Any]:
    """Subscribe ``url``, send it a test alert; the delivery once it is no longer pending (or
    after 10 s)."""
    r = await env.http.post(
        "/admin/api/webhooks",
        headers=env.admin_headers,
        json={"url": url, "events": ["key.expiring"]},
    )
    assert r.status_code == 201, r.text
    r = await env.http.post(f"/admin/api/webhooks/{r.json()['id']}/test",
                            headers=env.admin_headers)  # fmt: skip
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 10
    while True:
        r = await env.http.get("/admin/api/webhooks/deliveries", headers=env.admin_headers)
        (delivery,) = r.json()["data"]
        if delivery["state"] != "pending" or time.monotonic() > deadline:
            return dict(delivery)
        await asyncio.sleep(0.05)
