"""Alert webhooks end to end, with a real HTTP receiver (``tests/utils/webhook_receiver.py``) and
the real app: a budget's soft-limit alert arrives once with a valid HMAC signature; a receiver
that answers 500 twice gets a third attempt (recorded: 3 attempts, succeeded); a hung receiver
times out and is retried within bounds; redirects are not followed; two replicas on one
database deliver each event once; the admin API's checks, secrets shown once, audit events;
expiring keys, repeated quota refusals and engine restarts alert once."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import hmac
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import update

from loraplex.platform import tenants
from loraplex.platform.db.models import WebhookEvent
from loraplex.platform.webhooks import signing, store
from loraplex.platform.webhooks.service import Alert, WebhookService
from tests.utils import registry as rf
from tests.utils.fakes import FakeEngineClient
from tests.utils.registry import CONFIG, WEIGHTS, lying_header, registry_env, upload
from tests.utils.tenancy import TenancyEnv, bearer, tenancy_env
from tests.utils.webhook_receiver import HANG, Receiver

pytestmark = pytest.mark.anyio

MESSAGES: list[Any] = [{"role": "user", "content": "t30 t31"}]
registry_models = rf.registry_models


@pytest.fixture(autouse=True)
def fast_webhooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seconds, not minutes: poll often, retry after 0.1 s, 1 s per attempt."""
    for name, value in {"POLL_S": "0.05", "RETRY_BASE_S": "0.1", "TIMEOUT_S": "1",
                        "MAX_ATTEMPTS": "3", "QUOTA_REFUSALS": "3"}.items():  # fmt: skip
        monkeypatch.setenv(f"LORAPLEX_WEBHOOK_{name}", value)


@pytest.fixture
async def env(
    tmp_path: Path, fake: FakeEngineClient, tokenizer: Any, database_url: str | None
) -> AsyncIterator[TenancyEnv]:
    """The app on SQLite and on PostgreSQL, its lifespan (the webhook worker) running."""
    async with (
        tenancy_env(tmp_path, fake, tokenizer, database_url=database_url) as env,
        env.app.platform.lifespan(own_client=False),
    ):
        yield env


def _service(env: TenancyEnv) -> WebhookService:
    assert env.app.platform.tenancy is not None
    return env.app.platform.tenancy.webhooks


async def _subscribe(env: TenancyEnv, url: str, events: list[str]) -> dict[str, Any]:
    r = await env.http.post(
        "/admin/api/webhooks", headers=env.admin_headers, json={"url": url, "events": events}
    )
    assert r.status_code == 201, r.text
    created: dict[str, Any] = r.json()
    return created


async def _deliveries(env: TenancyEnv) -> list[dict[str, Any]]:
    r = await env.http.get("/admin/api/webhooks/deliveries", headers=env.admin_headers)
    assert r.status_code == 200, r.text
    data: list[dict[str, Any]] = r.json()["data"]
    return data


async def _settled(env: TenancyEnv, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The deliveries once none is pending."""
    deadline = time.monotonic() + timeout
    while True:
        found = await _deliveries(env)
        if found and all(d["state"] != "pending" for d in found):
            return found
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.05)


def _check_signature(secret: str, headers: dict[str, str], body: bytes) -> None:
    """The receiver's check, written out: HMAC-SHA256(secret, "<t>.<body>") in hex."""
    parts = dict(p.split("=", 1) for p in headers["X-Loraplex-Signature"].split(","))
    expected = hmac.new(secret.encode(), parts["t"].encode() + b"." + body, hashlib.sha256)
    assert hmac.compare_digest(parts["v1"], expected.hexdigest())
    assert abs(time.time() - int(parts["t"])) < 60
    assert signing.verify(secret, headers["X-Loraplex-Signature"], body)
    assert not signing.verify(secret, headers["X-Loraplex-Signature"], body + b" ")
    assert not signing.verify("whsec_other", headers["X-Loraplex-Signature"], body)


async def test_the_soft_limit_alert_arrives_once_signed(env: TenancyEnv) -> None:
    key = env.tenant("acme")
    with Receiver() as receiver:
        hook = await _subscribe(env, receiver.url, ["budget.soft_limit_crossed"])
        r = await env.http.post(
            "/admin/api/tenants/acme/budgets", headers=env.admin_headers,
            json={"metric": "tokens", "period": "day", "limit": 2000, "soft_percent": 50},
        )  # fmt: skip
        assert r.status_code == 201, r.text
        client = openai.AsyncOpenAI(
            api_key=key, base_url="http://test/v1", http_client=env.http, max_retries=0
        )
        with pytest.raises(openai.RateLimitError):  # past the soft limit, on to the hard one
            for _ in range(100):
                await client.chat.completions.create(
                    model="tiny-chat", messages=MESSAGES, max_tokens=50
                )
        (got,) = await receiver.wait_for(1)
        await asyncio.sleep(0.5)  # the hard limit and later requests alert nothing more here
        assert len(receiver.received) == 1
    _check_signature(hook["secret"], got.headers, got.body)
    body = json.loads(got.body)
    assert body["type"] == "budget.soft_limit_crossed" == got.headers["X-Loraplex-Event-Type"]
    assert body["id"] == got.headers["X-Loraplex-Event-Id"] and body["id"].startswith("evt_")
    data = body["data"]
    assert data["tenant"] == "acme" and data["soft_percent"] == 50 and data["limit"] == 2000
    assert 1000 <= data["used"] < 2000 + 200
    (delivery,) = await _settled(env)
    assert delivery["state"] == "succeeded" and delivery["attempts"] == 1
    assert delivery["last_status"] == 200 and delivery["event_id"] == body["id"]


async def test_a_receiver_failing_twice_gets_the_third_attempt(env: TenancyEnv) -> None:
    with Receiver(plan=[500, 500]) as receiver:
        hook = await _subscribe(env, receiver.url, ["key.expiring"])
        r = await env.http.post(f"/admin/api/webhooks/{hook['id']}/test", headers=env.admin_headers)
        assert r.status_code == 202, r.text
        got = await receiver.wait_for(3)
        (delivery,) = await _settled(env)
    assert delivery["state"] == "succeeded" and delivery["attempts"] == 3
    assert delivery["last_status"] == 200 and delivery["last_error"] is None
    assert delivery["event_id"] == r.json()["event_id"]
    # The same event and body each time, signed each time, numbered 1, 2, 3.
    assert len({g.body for g in got}) == 1
    assert [g.headers["X-Loraplex-Delivery-Attempt"] for g in got] == ["1", "2", "3"]
    assert {g.headers["X-Loraplex-Event-Id"] for g in got} == {delivery["event_id"]}
    for g in got:
        _check_signature(hook["secret"], g.headers, g.body)
    assert got[1].at - got[0].at >= 0.1 and got[2].at - got[1].at >= 0.2  # backoff doubles


async def test_a_hung_receiver_times_out_and_attempts_are_bounded(env: TenancyEnv) -> None:
    with Receiver(default=HANG) as receiver:
        hook = await _subscribe(env, receiver.url, ["key.expiring"])
        r = await env.http.post(f"/admin/api/webhooks/{hook['id']}/test", headers=env.admin_headers)
        assert r.status_code == 202
        (delivery,) = await _settled(env, timeout=15)
        assert len(receiver.received) == 3  # MAX_ATTEMPTS
    assert delivery["state"] == "failed" and delivery["attempts"] == 3
    assert delivery["last_error"] == "no answer within 1 s" and delivery["last_status"] is None
    assert (
        900 <= delivery["last_duration_ms"] < 6000
    )  # the 1 s deadline, with room for a slow runner


async def test_redirects_are_not_followed(env: TenancyEnv) -> None:
    with Receiver(default=302) as receiver:
        hook = await _subscribe(env, receiver.url, ["key.expiring"])
        await env.http.post(f"/admin/api/webhooks/{hook['id']}/test", headers=env.admin_headers)
        (delivery,) = await _settled(env)
    assert delivery["state"] == "failed" and delivery["last_status"] == 302
    assert "redirects are not followed" in delivery["last_error"]
    assert "http://elsewhere.invalid/hook" in delivery["last_error"]


async def test_the_admin_api_checks_shows_the_secret_once_and_audits(env: TenancyEnv) -> None:
    h = env.admin_headers
    for url, why in [("ftp://example.com/x", "only http:// and https://"),
                     ("http://user:pw@example.com/", "credentials"),
                     ("http://exa mple.com/", "spaces"), ("https:///nohost", "no host")]:  # fmt: skip
        r = await env.http.post("/admin/api/webhooks", headers=h,
                                json={"url": url, "events": ["key.expiring"]})  # fmt: skip
        assert r.status_code == 400 and why in r.json()["error"]["message"].lower(), (url, r.text)
        assert r.json()["error"]["param"] == "url"
    r = await env.http.post("/admin/api/webhooks", headers=h,
                            json={"url": "https://example.com/", "events": ["budget.bogus"]})  # fmt: skip
    assert r.status_code == 400 and "budget.soft_limit_crossed" in r.json()["error"]["message"]
    created = await _subscribe(env, "https://example.com/hook", ["key.expiring"])
    assert created["secret"].startswith("whsec_")
    listed = await env.http.get("/admin/api/webhooks", headers=h)
    one = await env.http.get(f"/admin/api/webhooks/{created['id']}", headers=h)
    for text in (listed.text, one.text):
        assert created["secret"] not in text and "secret" not in text
    assert one.json()["url"] == "https://example.com/hook"
    gone = await env.http.delete(f"/admin/api/webhooks/{created['id']}", headers=h)
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    for method, path in [("GET", "/admin/api/webhooks/999"), ("DELETE", "/admin/api/webhooks/999"),
                         ("POST", "/admin/api/webhooks/999/test"),
                         ("GET", "/admin/api/webhooks/abc")]:  # fmt: skip
        r = await env.http.request(method, path, headers=h)
        assert r.status_code == 404 and r.json()["error"]["code"] == "webhook_not_found"
    audit = await env.http.get("/admin/api/audit?action=webhook.", headers=h)
    events = audit.json()["data"]
    assert [e["action"] for e in events] == ["webhook.delete", "webhook.create"]
    assert created["secret"] not in audit.text


async def test_an_expiring_key_alerts_once(env: TenancyEnv) -> None:
    with Receiver() as receiver:
        await _subscribe(env, receiver.url, ["key.expiring"])
        with env.store.db.session() as session:
            acme = tenants.create_tenant(session, "admin", "acme", quotas=tenants.Quotas())
            soon = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2)
            later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=30)
            key, _ = tenants.create_key(session, "admin", acme, expires_at=soon, name="ci")
            tenants.create_key(session, "admin", acme, expires_at=later)
            public_id = key.public_id
        service = _service(env)
        for _ in range(3):  # every check finds it; it is sent once
            assert await service.check_keys() == 1
            await service.record_pending()
        (got,) = await receiver.wait_for(1)
        await asyncio.sleep(0.3)
        assert len(receiver.received) == 1
    data = json.loads(got.body)["data"]
    assert data == {"tenant": "acme", "key": public_id, "name": "ci",
                    "expires_at": soon.replace(microsecond=soon.microsecond).isoformat()}  # fmt: skip


async def test_repeated_quota_refusals_alert_once_per_window(env: TenancyEnv) -> None:
    key = env.tenant("acme", quotas=tenants.Quotas(requests_per_minute=1))
    with Receiver() as receiver:
        await _subscribe(env, receiver.url, ["quota.exhausted"])
        statuses = []
        for _ in range(6):  # 1 admitted, 5 refused: the 3rd refusal alerts (QUOTA_REFUSALS)
            r = await env.http.post("/v1/chat/completions", headers=bearer(key),
                                    json={"model": "tiny-chat", "messages": MESSAGES,
                                          "max_tokens": 2})  # fmt: skip
            statuses.append(r.status_code)
        assert statuses == [200, 429, 429, 429, 429, 429]
        (got,) = await receiver.wait_for(1)
        await asyncio.sleep(0.3)
        assert len(receiver.received) == 1
    body = json.loads(got.body)
    assert body["type"] == "quota.exhausted"
    assert body["data"]["tenant"] == "acme" and body["data"]["refusals"] == 3


async def test_an_engine_restart_alerts(env: TenancyEnv, fake: FakeEngineClient) -> None:
    service = _service(env)
    with Receiver() as receiver:
        await _subscribe(env, receiver.url, ["engine.restarted"])
        assert not await service.check_engine(fake)  # the first look notes the count
        fake.engine_stats["engine_restarts"] = fake.engine_stats.get("engine_restarts", 0) + 1
        assert await service.check_engine(fake)
        assert not await service.check_engine(fake)
        await service.record_pending()
        (got,) = await receiver.wait_for(1)
    body = json.loads(got.body)
    assert body["type"] == "engine.restarted" and body["data"]["replica"] == service.replica


@pytest.fixture
def patient_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempts that do not time out on a busy runner: a timed-out attempt is retried and so
    delivered twice by design (at least once; receivers deduplicate by the event id), which
    is not what the replicas test is about (two workers claiming from one database)."""
    monkeypatch.setenv("LORAPLEX_WEBHOOK_TIMEOUT_S", "20")


async def test_two_replicas_deliver_each_event_once(
    patient_attempts: None, replicas: list[TenancyEnv]
) -> None:
    a, b = replicas
    assert _service(a).settings.timeout_s == _service(b).settings.timeout_s == 20
    with Receiver() as receiver:
        await _subscribe(a, receiver.url, ["engine.restarted"])
        # Both replicas see the same thing (one alert), and 30 more events each sees once;
        # both workers claim from the one database.
        same = Alert("engine.restarted", "engine.restarted:shared:1", {"restarts": 1})
        for env in (a, b):
            _service(env).emit(same)
        with a.store.db.session() as session:
            for n in range(30):
                store.record_event(session, "engine.restarted", f"n{n}", {"n": n}, time.time())
        got = await receiver.wait_for(31)
        await asyncio.sleep(0.5)
    ids = [g.headers["X-Loraplex-Event-Id"] for g in receiver.received]
    assert len(ids) == len(set(ids)) == 31
    states = await _settled(a)
    assert len(states) == 31 and all(d["attempts"] == 1 for d in states), [
        (d["attempts"], d["last_error"], d["state"]) for d in states if d["attempts"] != 1
    ]
    assert got


async def test_adapter_failures_alert(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    """An upload refused by validation (a lying safetensors header), one the engine refuses to
    load (a rank over its real limit), and a version whose engine copy and stored files are
    gone (its requests get 422 adapter_failed: one alert for both requests)."""
    a, r16 = registry_models.adapters["a"], registry_models.adapters["r16"]
    async with (
        registry_env(tmp_path, registry_models, tokenizer, advertised_rank=64) as env,
        env.app.platform.lifespan(own_client=False),
    ):
        token = env.tenant("acme")
        with Receiver() as receiver:
            await _subscribe(
                env, receiver.url, ["adapter.validation_failed", "adapter.load_failed"]
            )
            lying = {CONFIG: a.config, WEIGHTS: lying_header(a.weights)}
            assert (await upload(env.http, token, "bot", lying)).status_code == 400
            r = await upload(env.http, token, "big", r16.files())
            assert r.json()["error"]["code"] == "rank_too_large"
            r = await upload(env.http, token, "gone", a.files())
            content = r.json()["versions"][-1]["content_sha256"]
            env.fake.lose_adapter(content)
            shutil.rmtree(env.store.data_dir / "adapters" / content)
            for _ in range(2):
                r = await env.http.post("/v1/chat/completions", headers=bearer(token),
                                        json={"model": "gone", "messages": MESSAGES})  # fmt: skip
                assert r.json()["error"]["code"] == "adapter_failed", r.text
            got = await receiver.wait_for(3)
            await asyncio.sleep(0.3)
            assert len(receiver.received) == 3
        found = {
            (b["type"], b["data"]["adapter"]): b["data"]
            for b in map(json.loads, (g.body for g in got))
        }
        assert set(found) == {("adapter.validation_failed", "bot"), ("adapter.load_failed", "big"),
                              ("adapter.load_failed", "gone@1")}  # fmt: skip
        assert all(d["tenant"] == "acme" for d in found.values())
        assert found[("adapter.load_failed", "big")]["code"] == "rank_too_large"
        assert found[("adapter.load_failed", "gone@1")]["code"] == "adapter_failed"


async def test_old_events_are_purged_with_their_deliveries(env: TenancyEnv) -> None:
    hook = await _subscribe(env, "http://127.0.0.1:9/never", ["engine.restarted"])
    with env.store.db.session() as session:
        for n in range(3):
            store.record_event(session, "engine.restarted", f"old{n}", {}, time.time() + 3600)
        store.record_event(session, "engine.restarted", "new", {}, time.time() + 3600)
        old = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=31)
        session.execute(
            update(WebhookEvent).where(WebhookEvent.event_id != store.event_id_of("new"))
            .values(created_at=old)
        )  # fmt: skip
    assert await _service(env).purge() == 3
    assert await _service(env).purge() == 0
    left = await env.http.get(
        f"/admin/api/webhooks/deliveries?webhook_id={hook['id']}", headers=env.admin_headers
    )
    assert [d["event_id"] for d in left.json()["data"]] == [store.event_id_of("new")]
