"""Tenant keys and the admin token decide the caller; every refusal is immediate and uniform."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from fastapi import Depends
from sqlalchemy import select

from loraplex.platform import admin_token, tenants
from loraplex.platform.access import require_scope
from loraplex.platform.auth import SCOPE_ADAPTERS_WRITE, SCOPE_INFERENCE, Caller
from loraplex.platform.db.models import ApiKey, PlatformSetting, utcnow
from loraplex.platform.keys import PREFIX, parse_key
from tests.utils.fakes import FakeEngineClient
from tests.utils.tenancy import TenancyEnv, bearer, tenancy_env

pytestmark = pytest.mark.anyio

INFERENCE_CALLER = Depends(require_scope(SCOPE_INFERENCE))
ADMIN_CALLER = Depends(require_scope("admin"))
CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "t30"}], "max_tokens": 1}


def add_probe_routes(env: TenancyEnv) -> None:
    """``/test/whoami`` echoes the caller; ``/test/admin-only`` needs the admin scope."""

    async def whoami(caller: Caller = INFERENCE_CALLER) -> dict[str, Any]:
        return {
            "id": caller.id,
            "tenant_id": caller.tenant_id,
            "key_id": caller.key_id,
            "scopes": sorted(caller.scopes),
            "cache_salt": caller.cache_salt,
        }

    async def admin_only(caller: Caller = ADMIN_CALLER) -> dict[str, str]:
        return {"id": caller.id}

    env.app.add_api_route("/test/whoami", whoami)
    env.app.add_api_route("/test/admin-only", admin_only)


def tenant_row(env: TenancyEnv, name: str) -> tuple[int, str]:
    with env.store.db.session() as session:
        tenant = tenants.require_tenant(session, name)
        return tenant.id, tenant.cache_salt


def key_row(env: TenancyEnv, token: str) -> ApiKey:
    parsed = parse_key(token)
    assert parsed is not None
    with env.store.db.session() as session:
        key = session.scalars(select(ApiKey).where(ApiKey.public_id == parsed[0])).one()
        session.expunge(key)
        return key


async def test_a_key_authenticates_as_its_own_tenant(tenancy: TenancyEnv) -> None:
    add_probe_routes(tenancy)
    acme, globex = tenancy.tenant("acme"), tenancy.tenant("globex")
    for name, key in (("acme", acme), ("globex", globex)):
        tenant_id, salt = tenant_row(tenancy, name)
        public_id = key[len(PREFIX) :].split("_")[0]
        r = await tenancy.http.get("/test/whoami", headers=bearer(key))
        assert r.status_code == 200, r.text
        assert r.json() == {
            "id": f"tenant:{name}/key:{public_id}",
            "tenant_id": str(tenant_id),
            "key_id": public_id,
            "scopes": sorted([SCOPE_ADAPTERS_WRITE, SCOPE_INFERENCE]),
            "cache_salt": salt,
        }
    # The tenants' prefix-cache salts reach the engine and differ.
    for key in (acme, globex):
        r = await tenancy.http.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
        assert r.status_code == 200, r.text
    salts = [s.cache_extra_keys for s in tenancy.fake.submitted]
    assert salts == [(f"salt:{tenant_row(tenancy, n)[1]}",) for n in ("acme", "globex")]
    assert salts[0] != salts[1]
    # The engine's requests carry their tenant (its scheduling policy sees it); the operator's
    # carry none.
    tenants = [s.tenant for s in tenancy.fake.submitted]
    assert tenants == [str(tenant_row(tenancy, n)[0]) for n in ("acme", "globex")]
    r = await tenancy.http.post("/v1/chat/completions", json=CHAT, headers=tenancy.admin_headers)
    assert r.status_code == 200 and tenancy.fake.submitted[-1].tenant is None


async def test_every_bad_key_gets_the_same_401(tenancy: TenancyEnv) -> None:
    acme, globex = tenancy.tenant("acme"), tenancy.tenant("globex")
    acme_id, acme_secret = parse_key(acme) or ("", "")
    globex_id, _ = parse_key(globex) or ("", "")
    bad = [
        f"{PREFIX}{acme_id}_{'A' * 32}",  # a real public id, a wrong secret
        f"{PREFIX}{'z' * 12}_{acme_secret}",  # an unknown public id, a real secret
        f"{PREFIX}{globex_id}_{acme_secret}",  # one tenant's id with another's secret
        "not-a-key",
        f"{PREFIX}{acme_id}_{acme_secret}x",  # one character too many
        "sk-" + "x" * 48,  # an OpenAI-looking key
        admin_token.TOKEN_PREFIX + "y" * 43,  # an admin-looking token (the admin token is env)
    ]
    bodies = []
    for token in bad:
        r = await tenancy.http.post("/v1/chat/completions", json=CHAT, headers=bearer(token))
        assert r.status_code == 401, (token, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        bodies.append(r.json())
    assert all(b == bodies[0] for b in bodies), bodies
    assert bodies[0]["error"]["code"] == "invalid_api_key"
    assert bodies[0]["error"]["type"] == "invalid_request_error"
    assert acme_secret not in str(bodies[0])
    assert tenancy.fake.submitted == []


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, "invalid_authorization_header"),
        ({"Authorization": "Bearer"}, "invalid_authorization_header"),
        ({"Authorization": "Bearer    "}, "invalid_authorization_header"),
    ],
)
async def test_missing_or_malformed_header_is_401(
    tenancy: TenancyEnv, headers: dict[str, str], code: str
) -> None:
    r = await tenancy.http.get("/v1/models", headers=headers)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == code


async def test_a_revoked_key_fails_on_the_next_request(tenancy: TenancyEnv) -> None:
    key, other = tenancy.tenant("acme"), tenancy.tenant("acme")
    assert (await tenancy.http.get("/v1/models", headers=bearer(key))).status_code == 200
    with tenancy.store.db.session() as session:
        tenant = tenants.require_tenant(session, "acme")
        tenants.revoke_key(session, "admin", tenant, key_row(tenancy, key).public_id)
    r = await tenancy.http.get("/v1/models", headers=bearer(key))
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert "revoked" in r.json()["error"]["message"]
    # the tenant's other key is untouched
    assert (await tenancy.http.get("/v1/models", headers=bearer(other))).status_code == 200


async def test_an_expired_key_fails_on_the_next_request(tenancy: TenancyEnv) -> None:
    key = tenancy.tenant("acme")
    public_id = key_row(tenancy, key).public_id
    with tenancy.store.db.session() as session:
        row = session.scalars(select(ApiKey).where(ApiKey.public_id == public_id)).one()
        row.expires_at = utcnow() + dt.timedelta(hours=1)
    assert (await tenancy.http.get("/v1/models", headers=bearer(key))).status_code == 200
    with tenancy.store.db.session() as session:
        row = session.scalars(select(ApiKey).where(ApiKey.public_id == public_id)).one()
        row.expires_at = utcnow() - dt.timedelta(seconds=1)
    r = await tenancy.http.get("/v1/models", headers=bearer(key))
    assert r.status_code == 401
    assert "expired" in r.json()["error"]["message"]


async def test_a_suspended_tenants_keys_get_403(tenancy: TenancyEnv) -> None:
    acme, globex = tenancy.tenant("acme"), tenancy.tenant("globex")

    def set_status(status: str) -> None:
        with tenancy.store.db.session() as session:
            tenant = tenants.require_tenant(session, "acme")
            tenants.update_tenant(session, "admin", tenant, status=status)

    set_status("suspended")
    r = await tenancy.http.post("/v1/chat/completions", json=CHAT, headers=bearer(acme))
    assert r.status_code == 403
    error = r.json()["error"]
    assert error["code"] == "tenant_suspended" and "suspended" in error["message"]
    assert error["type"] == "permission_error"
    assert (await tenancy.http.get("/v1/models", headers=bearer(globex))).status_code == 200
    set_status("active")
    assert (await tenancy.http.get("/v1/models", headers=bearer(acme))).status_code == 200


async def test_the_admin_token_is_the_operator_and_tenant_keys_are_never_admin(
    tenancy: TenancyEnv,
) -> None:
    add_probe_routes(tenancy)
    key = tenancy.tenant("acme")
    r = await tenancy.http.get("/v1/models", headers=tenancy.admin_headers)
    assert r.status_code == 200, r.text
    r = await tenancy.http.get("/test/admin-only", headers=tenancy.admin_headers)
    assert r.status_code == 200 and r.json() == {"id": "admin"}
    r = await tenancy.http.get("/test/whoami", headers=tenancy.admin_headers)
    assert r.json()["tenant_id"] is None and "admin" in r.json()["scopes"]

    r = await tenancy.http.get("/test/admin-only", headers=bearer(key))
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    # Even a key row that claims the admin scope does not get it.
    public_id = key_row(tenancy, key).public_id
    with tenancy.store.db.session() as session:
        row = session.scalars(select(ApiKey).where(ApiKey.public_id == public_id)).one()
        row.scopes = ["inference", "admin"]
    r = await tenancy.http.get("/test/admin-only", headers=bearer(key))
    assert r.status_code == 403
    r = await tenancy.http.get("/test/admin-only", headers=bearer("wrong-admin-token-123456"))
    assert r.status_code == 401


async def test_scopes_are_enforced(tenancy: TenancyEnv) -> None:
    writer = tenancy.tenant("acme", scopes=(SCOPE_ADAPTERS_WRITE,))
    reader = tenancy.tenant("acme", scopes=(SCOPE_INFERENCE,))
    r = await tenancy.http.post("/v1/chat/completions", json=CHAT, headers=bearer(writer))
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "insufficient_scope"
    assert "inference" in r.json()["error"]["message"]
    r = await tenancy.http.post("/v1/chat/completions", json=CHAT, headers=bearer(reader))
    assert r.status_code == 200, r.text


async def test_last_used_at_is_written_at_most_once_a_minute(tenancy: TenancyEnv) -> None:
    key = tenancy.tenant("acme")
    assert key_row(tenancy, key).last_used_at is None
    t0 = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.timezone.utc)
    now = [t0]
    tenancy.app.platform.authenticator.clock = lambda: now[0]
    for offset, expected in ((0, t0), (30, t0), (59, t0), (61, t0 + dt.timedelta(seconds=61))):
        now[0] = t0 + dt.timedelta(seconds=offset)
        assert (await tenancy.http.get("/v1/models", headers=bearer(key))).status_code == 200
        assert key_row(tenancy, key).last_used_at == expected, offset


async def test_a_generated_admin_token_is_shown_once_and_stored_hashed(
    tmp_path: Path, fake: FakeEngineClient, tokenizer: Any, database_url: str | None
) -> None:
    async with tenancy_env(
        tmp_path, fake, tokenizer, admin_token=None, database_url=database_url
    ) as env:
        first = admin_token.ensure(env.store.db, env.store.settings)
        assert first.source == "generated" and first.token is not None
        assert first.token.startswith(admin_token.TOKEN_PREFIX)
        assert len(first.token) - len(admin_token.TOKEN_PREFIX) >= 43  # >= 256 bits, base64
        assert first.token in first.message()
        again = admin_token.ensure(env.store.db, env.store.settings)
        assert again.source == "stored" and again.token is None
        assert "rotate" in again.message()
        with env.store.db.session() as session:
            rows = list(session.scalars(select(PlatformSetting)))
        assert [(r.key, r.value) for r in rows] == [
            (admin_token.SETTING_KEY, admin_token.token_sha256(first.token))
        ]

        r = await env.http.get("/v1/models", headers=bearer(first.token))
        assert r.status_code == 200, r.text
        with env.store.db.session() as session:
            new = admin_token.rotate(session, env.store.settings, "admin (cli)")
        assert new != first.token
        assert (await env.http.get("/v1/models", headers=bearer(first.token))).status_code == 401
        assert (await env.http.get("/v1/models", headers=bearer(new))).status_code == 200
        # env's test token is not configured here, so it is not accepted either
        assert (await env.http.get("/v1/models", headers=env.admin_headers)).status_code == 401


def test_an_env_admin_token_replaces_the_stored_one_and_must_be_strong(tmp_path: Path) -> None:
    from loraplex.platform.settings import TenancySettings

    settings = TenancySettings(data_dir=tmp_path, admin_token="short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        admin_token.AdminCredential(settings)
    strong = TenancySettings(data_dir=tmp_path, admin_token="x" * 32)
    with pytest.raises(admin_token.AdminTokenError, match="LORAPLEX_ADMIN_TOKEN"):
        admin_token.rotate(None, strong, "admin (cli)")  # type: ignore[arg-type]
