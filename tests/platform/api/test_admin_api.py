"""The operator's API under /admin/api: tenants, keys, engine state; tenants are kept out."""

from __future__ import annotations

import datetime as dt
import secrets
import statistics
import time
from typing import Any

import pytest
from sqlalchemy import insert

from loraplex.engine.info import SpecDecodeStats
from loraplex.platform import engine_state
from loraplex.platform.db.models import Tenant, utcnow
from tests.utils.tenancy import bearer

pytestmark = pytest.mark.anyio

COMPLETION = {"model": "tiny-chat", "prompt": "t30", "max_tokens": 2}


async def _create(env: Any, name: str, **body: Any) -> dict[str, Any]:
    r = await env.http.post(
        "/admin/api/tenants", headers=env.admin_headers, json={"name": name, **body}
    )
    assert r.status_code == 201, r.text
    return dict(r.json())


async def _new_key(env: Any, tenant: str, **body: Any) -> dict[str, Any]:
    r = await env.http.post(
        f"/admin/api/tenants/{tenant}/keys", headers=env.admin_headers, json=body
    )
    assert r.status_code == 201, r.text
    return dict(r.json())


async def test_tenant_crud_with_quotas(tenancy: Any) -> None:
    env = tenancy
    quotas = {"requests_per_minute": 60, "tokens_per_minute": 10_000}
    created = await _create(env, "acme", display_name="Acme Corp", quotas=quotas)
    assert created["quotas"] == {**quotas, "max_concurrent_requests": None, "max_adapters": None}
    assert created["status"] == "active" and created["display_name"] == "Acme Corp"

    got = (await env.http.get("/admin/api/tenants/acme", headers=env.admin_headers)).json()
    assert got == created

    # Only the limits given change; null lifts one.
    patch = {"quotas": {"max_concurrent_requests": 4, "tokens_per_minute": None}}
    r = await env.http.patch("/admin/api/tenants/acme", headers=env.admin_headers, json=patch)
    assert r.status_code == 200, r.text
    assert r.json()["quotas"] == {
        "requests_per_minute": 60,
        "tokens_per_minute": None,
        "max_concurrent_requests": 4,
        "max_adapters": None,
    }
    assert r.json()["display_name"] == "Acme Corp"

    r = await env.http.delete("/admin/api/tenants/acme", headers=env.admin_headers)
    assert r.status_code == 200 and r.json() == {"id": "acme", "object": "tenant", "deleted": True}
    r = await env.http.get("/admin/api/tenants/acme", headers=env.admin_headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"
    r = await env.http.delete("/admin/api/tenants/acme", headers=env.admin_headers)
    assert r.status_code == 404


async def test_suspend_refuses_keys_on_the_next_request_and_resume_restores(
    tenancy: Any,
) -> None:
    env = tenancy
    key = env.tenant("acme")
    assert (await env.http.post("/v1/completions", headers=bearer(key), json=COMPLETION)).is_success
    r = await env.http.patch(
        "/admin/api/tenants/acme", headers=env.admin_headers, json={"status": "suspended"}
    )
    assert r.json()["status"] == "suspended"
    r = await env.http.post("/v1/completions", headers=bearer(key), json=COMPLETION)
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_suspended"
    await env.http.patch(
        "/admin/api/tenants/acme", headers=env.admin_headers, json={"status": "active"}
    )
    assert (await env.http.post("/v1/completions", headers=bearer(key), json=COMPLETION)).is_success


async def test_deleting_a_tenant_removes_its_keys_and_collects_its_adapters(
    tenancy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = tenancy
    key = env.tenant("acme")
    collected: list[bool] = []

    class Registry:
        async def collect_garbage(self) -> list[str]:
            collected.append(True)
            return []

    # The tenant service owns the deletion's effects: it asks the registry to collect.
    monkeypatch.setattr(env.app.platform.tenancy.tenants, "registry", Registry())
    assert (await env.http.delete("/admin/api/tenants/acme", headers=env.admin_headers)).is_success
    assert collected == [True]
    r = await env.http.post("/v1/completions", headers=bearer(key), json=COMPLETION)
    assert r.status_code == 401


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"name": "Bad/Name"}, "name", "invalid_tenant_name"),
        ({"name": ""}, "name", "invalid_tenant_name"),
        ({"name": "acme", "quotas": {"requests_per_minute": 0}}, "requests_per_minute", None),
        ({"name": "acme", "quotas": {"requests_per_minute": "5"}}, None, None),
        ({"name": "acme", "quotas": {"requests_per_min": 5}}, None, None),
        ({"name": "acme", "quotas": {"tokens_per_minute": 1.5}}, None, None),
    ],
)
async def test_bad_tenant_bodies_are_400_saying_what_to_fix(
    tenancy: Any, body: dict[str, Any], param: str | None, code: str | None
) -> None:
    env = tenancy
    r = await env.http.post("/admin/api/tenants", headers=env.admin_headers, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert param in (error["param"] or "")
    if code is not None:
        assert error["code"] == code
    listed = (await env.http.get("/admin/api/tenants", headers=env.admin_headers)).json()
    assert listed["total"] == 0  # nothing was created


async def test_duplicate_tenant_is_409_and_unknown_fields_are_refused(tenancy: Any) -> None:
    env = tenancy
    r = await env.http.post(
        "/admin/api/tenants",
        headers=env.admin_headers,
        json={"name": "acme", "owner": "someone-else", "tenant_id": 7},
    )  # issue 34.6: refused, never silently dropped (tests/platform/api/test_admin_strict_bodies)
    assert r.status_code == 400 and "'owner', 'tenant_id'" in r.json()["error"]["message"]
    await _create(env, "acme")
    r = await env.http.post("/admin/api/tenants", headers=env.admin_headers, json={"name": "acme"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "tenant_exists"


async def test_keys_are_shown_once_listed_masked_and_revoked_at_once(tenancy: Any) -> None:
    env = tenancy
    await _create(env, "acme")
    new = await _new_key(env, "acme", name="ci", scopes=["inference"])
    token = new["key"]
    assert token.startswith(f"lpx_{new['id']}_") and new["display"].endswith(token[-4:])
    assert new["scopes"] == ["inference"] and new["status"] == "active"
    assert (
        await env.http.post("/v1/completions", headers=bearer(token), json=COMPLETION)
    ).is_success

    r = await env.http.get("/admin/api/tenants/acme/keys", headers=env.admin_headers)
    (listed,) = r.json()["data"]
    assert token not in r.text and token[-32:] not in r.text  # the secret is never shown again
    assert listed["display"] == f"lpx_{new['id']}…{token[-4:]}"
    assert listed["name"] == "ci" and listed["last_used_at"] is not None
    assert "key" not in listed and "secret_sha256" not in listed

    r = await env.http.delete(
        f"/admin/api/tenants/acme/keys/{new['id']}", headers=env.admin_headers
    )
    assert r.status_code == 200 and r.json()["status"] == "revoked"
    r = await env.http.post("/v1/completions", headers=bearer(token), json=COMPLETION)
    assert r.status_code == 401
    # Idempotent; an unknown key, or one of another tenant, is 404.
    r = await env.http.delete(
        f"/admin/api/tenants/acme/keys/{new['id']}", headers=env.admin_headers
    )
    assert r.status_code == 200
    await _create(env, "other")
    r = await env.http.delete(
        f"/admin/api/tenants/other/keys/{new['id']}", headers=env.admin_headers
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "key_not_found"


async def test_key_expiry_and_scopes_are_checked(tenancy: Any) -> None:
    env = tenancy
    await _create(env, "acme")
    url = "/admin/api/tenants/acme/keys"
    past = (utcnow() - dt.timedelta(hours=1)).isoformat()
    r = await env.http.post(url, headers=env.admin_headers, json={"expires_at": past})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_expiry"
    r = await env.http.post(url, headers=env.admin_headers, json={"scopes": ["admin"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_scope"
    soon = (utcnow() + dt.timedelta(days=1)).isoformat()
    new = await _new_key(env, "acme", expires_at=soon)
    assert new["expires_at"] is not None and new["status"] == "active"


ADMIN_ROUTES = [
    ("GET", "/admin/api/tenants", None),
    ("POST", "/admin/api/tenants", {"name": "evil"}),
    ("GET", "/admin/api/tenants/acme", None),
    ("PATCH", "/admin/api/tenants/acme", {"quotas": {"requests_per_minute": 10**9}}),
    ("DELETE", "/admin/api/tenants/acme", None),
    ("POST", "/admin/api/tenants/acme/keys", {}),
    ("GET", "/admin/api/tenants/acme/keys", None),
    ("DELETE", "/admin/api/tenants/acme/keys/whatever", None),
    ("GET", "/admin/api/tenants/acme/usage", None),
    ("GET", "/admin/api/usage", None),
    ("GET", "/admin/api/audit", None),
    ("GET", "/admin/api/engine", None),
]


async def test_tenants_cannot_use_the_admin_api(tenancy: Any) -> None:
    """A tenant key (even with every tenant scope) gets 403 on every admin route, no key 401;
    nothing changes: a tenant cannot create keys or touch quotas."""
    env = tenancy
    key = env.tenant("acme")
    before = (await env.http.get("/admin/api/tenants/acme", headers=env.admin_headers)).json()
    for method, path, body in ADMIN_ROUTES:
        r = await env.http.request(method, path, headers=bearer(key), json=body)
        assert r.status_code == 403, (method, path, r.text)
        assert r.json()["error"]["code"] == "insufficient_scope"
        r = await env.http.request(method, path, json=body)
        assert r.status_code == 401, (method, path, r.text)
        r = await env.http.request(method, path, headers=bearer("lpx-not-a-key"), json=body)
        assert r.status_code == 401, (method, path, r.text)
    after = (await env.http.get("/admin/api/tenants/acme", headers=env.admin_headers)).json()
    assert after == before
    keys = (await env.http.get("/admin/api/tenants/acme/keys", headers=env.admin_headers)).json()
    assert len(keys["data"]) == 1


def _bulk_tenants(env: Any, count: int) -> None:
    now = utcnow()
    rows = [
        {
            "name": f"tenant-{i:05d}",
            "display_name": f"Customer {i}",
            "status": "active",
            "cache_salt": secrets.token_hex(16),
            "created_at": now,
            "updated_at": now,
        }
        for i in range(count)
    ]
    with env.store.db.session() as session:
        session.execute(insert(Tenant), rows)


async def _timed_get(env: Any, url: str, params: dict[str, Any]) -> tuple[float, Any]:
    times = []
    body = None
    for _ in range(5):
        t0 = time.perf_counter()
        r = await env.http.get(url, headers=env.admin_headers, params=params)
        times.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
        body = r.json()
    return statistics.median(times), body


async def test_listing_10000_tenants_pages_and_searches_fast(tenancy: Any) -> None:
    env = tenancy
    _bulk_tenants(env, 10_000)
    url = "/admin/api/tenants"

    first, page = await _timed_get(env, url, {"limit": 50})
    assert page["total"] == 10_000 and len(page["data"]) == 50
    assert [t["name"] for t in page["data"][:2]] == ["tenant-00000", "tenant-00001"]

    deep, page = await _timed_get(env, url, {"offset": 9_990, "limit": 500})
    assert [t["name"] for t in page["data"]] == [f"tenant-{i:05d}" for i in range(9_990, 10_000)]

    search, page = await _timed_get(env, url, {"search": "tenant-0999", "limit": 500})
    assert page["total"] == 10 and page["data"][0]["name"] == "tenant-09990"
    by_display, page = await _timed_get(env, url, {"search": "CUSTOMER 4242"})
    assert [t["name"] for t in page["data"]] == ["tenant-04242"]
    _, page = await _timed_get(env, url, {"search": "%"})  # literal, not a wildcard
    assert page["total"] == 0

    print(
        f"\n10,000 tenants: first page {first * 1000:.1f} ms, offset 9990 {deep * 1000:.1f} ms, "
        f"search {search * 1000:.1f} ms, display-name search {by_display * 1000:.1f} ms"
    )
    assert max(first, deep, search, by_display) < 0.3

    r = await env.http.get(url, headers=env.admin_headers, params={"limit": 501})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    r = await env.http.get(url, headers=env.admin_headers, params={"offset": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "offset"


async def test_engine_state(tenancy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    env = tenancy
    env.fake.engine_stats.update(
        num_running=3,
        num_waiting=1,
        kv_cache_usage=0.25,
        prefix_cache_hit_rate=0.5,
        lora_resident_device=2,
        lora_resident_host=5,
        lora_registered=9,
    )
    r = await env.http.get("/admin/api/engine", headers=env.admin_headers)
    assert r.status_code == 200, r.text
    state = r.json()
    assert (state["running"], state["waiting"], state["kv_cache_usage"]) == (3, 1, 0.25)
    assert state["prefix_cache_hit_rate"] == 0.5
    assert state["adapters"] == {"device": 2, "host": 5, "registered": 9}
    assert state["speculative"] is None  # no speculative decoding
    env.fake.engine_stats["speculative"] = SpecDecodeStats(
        "ngram", num_draft_tokens=10, num_accepted_tokens=4
    )
    state = (await env.http.get("/admin/api/engine", headers=env.admin_headers)).json()
    assert state["speculative"]["method"] == "ngram"
    assert state["speculative"]["acceptance_rate"] == 0.4

    monkeypatch.setattr(engine_state, "ENGINE_STATS_TIMEOUT_S", 0.05)
    env.fake.stats_delay = 1.0
    r = await env.http.get("/admin/api/engine", headers=env.admin_headers)
    assert r.status_code == 503 and "did not answer" in r.json()["error"]["message"]

    env.fake.alive = False
    r = await env.http.get("/admin/api/engine", headers=env.admin_headers)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "engine_unavailable"
