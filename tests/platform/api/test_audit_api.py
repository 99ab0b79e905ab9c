"""GET /admin/api/audit: an event for every change, filters, keyset pagination, operator only."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from loraplex.platform.db.models import utcnow
from tests.utils.tenancy import bearer

pytestmark = pytest.mark.anyio

AUDIT = "/admin/api/audit"


async def _audit(env: Any, **params: Any) -> dict[str, Any]:
    r = await env.http.get(AUDIT, headers=env.admin_headers, params=params)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def _changes(env: Any) -> str:
    """Create, change, suspend, resume tenants; create and revoke a key; delete a tenant.
    Returns the revoked key's public id."""
    admin = env.admin_headers
    http = env.http
    for name in ("acme", "globex"):
        r = await http.post("/admin/api/tenants", headers=admin, json={"name": name})
        assert r.status_code == 201
    await http.patch("/admin/api/tenants/acme", headers=admin, json={"display_name": "Acme"})
    await http.patch(
        "/admin/api/tenants/acme", headers=admin, json={"quotas": {"requests_per_minute": 5}}
    )
    await http.patch("/admin/api/tenants/acme", headers=admin, json={"status": "suspended"})
    await http.patch("/admin/api/tenants/acme", headers=admin, json={"status": "active"})
    key = (await http.post("/admin/api/tenants/acme/keys", headers=admin, json={})).json()
    await http.delete(f"/admin/api/tenants/acme/keys/{key['id']}", headers=admin)
    await http.delete("/admin/api/tenants/globex", headers=admin)
    return str(key["id"])


async def test_every_change_has_an_event_newest_first(tenancy: Any) -> None:
    env = tenancy
    since = (utcnow() - dt.timedelta(seconds=1)).isoformat()
    key_id = await _changes(env)
    events = (await _audit(env))["data"]
    assert [(e["action"], e["tenant"]) for e in reversed(events)] == [
        ("tenant.create", "acme"),
        ("tenant.create", "globex"),
        ("tenant.update", "acme"),
        ("tenant.update", "acme"),
        ("tenant.suspend", "acme"),
        ("tenant.resume", "acme"),
        ("key.create", "acme"),
        ("key.revoke", "acme"),
        ("tenant.delete", "globex"),
    ]
    assert all(e["actor"] == "admin" for e in events)
    ids = [e["id"] for e in events]
    assert ids == sorted(ids, reverse=True)

    quota_change = events[-4]
    assert quota_change["before"]["requests_per_minute"] is None
    assert quota_change["after"]["requests_per_minute"] == 5
    revoke = events[1]
    assert revoke["object_id"] == key_id and revoke["before"]["revoked_at"] is None
    assert revoke["after"]["revoked_at"] is not None
    delete = events[0]
    assert delete["before"]["name"] == "globex" and delete["after"] is None

    # Filters: tenant, exact action, action prefix (both spellings), actor, time.
    assert len((await _audit(env, tenant="globex"))["data"]) == 2
    assert [e["action"] for e in (await _audit(env, action="key."))["data"]] == [
        "key.revoke",
        "key.create",
    ]
    assert len((await _audit(env, action="key.*"))["data"]) == 2
    assert len((await _audit(env, action="tenant.suspend"))["data"]) == 1
    assert len((await _audit(env, action="tenant."))["data"]) == 7
    assert (await _audit(env, actor="tenant:acme/key:x"))["data"] == []
    assert len((await _audit(env, since=since))["data"]) == 9
    assert (await _audit(env, until=since))["data"] == []
    future = (utcnow() + dt.timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert (await _audit(env, since=future))["data"] == []


async def test_events_hold_no_secrets(tenancy: Any) -> None:
    env = tenancy
    await env.http.post("/admin/api/tenants", headers=env.admin_headers, json={"name": "acme"})
    new = (
        await env.http.post("/admin/api/tenants/acme/keys", headers=env.admin_headers, json={})
    ).json()
    r = await env.http.get(AUDIT, headers=env.admin_headers)
    assert new["key"][-32:] not in r.text
    assert "secret" not in r.text and "cache_salt" not in r.text


async def test_keyset_pagination_walks_the_log_once(tenancy: Any) -> None:
    env = tenancy
    for i in range(23):
        r = await env.http.post(
            "/admin/api/tenants", headers=env.admin_headers, json={"name": f"t{i:02d}"}
        )
        assert r.status_code == 201
    seen: list[int] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 10}
        if cursor is not None:
            params["before_id"] = cursor
        page = await _audit(env, **params)
        pages += 1
        seen += [e["id"] for e in page["data"]]
        cursor = page["next_before_id"]
        assert page["has_more"] == (cursor is not None)
        if cursor is None:
            break
    assert pages == 3 and len(seen) == 23 and len(set(seen)) == 23
    assert seen == sorted(seen, reverse=True)
    # A cursor combines with filters.
    page = await _audit(env, action="tenant.create", limit=5, before_id=seen[4])
    assert [e["id"] for e in page["data"]] == seen[5:10]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"limit": 501}, "limit"),
        ({"limit": 0}, "limit"),
        ({"before_id": 0}, "before_id"),
        ({"since": "yesterday"}, "since"),
        ({"until": "2025-13-01"}, "until"),
        ({"limit": "ten"}, "limit"),
    ],
)
async def test_bad_queries_are_400(tenancy: Any, params: dict[str, Any], param: str) -> None:
    env = tenancy
    r = await env.http.get(AUDIT, headers=env.admin_headers, params=params)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


async def test_only_the_operator_reads_the_log(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme")
    r = await env.http.get(AUDIT, headers=bearer(key))
    assert r.status_code == 403
    r = await env.http.get(AUDIT)
    assert r.status_code == 401
