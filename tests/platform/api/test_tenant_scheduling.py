"""A tenant's scheduling settings (issue 14): its weight, the fair policy's share, reaches the
engine when the operator sets it (no restart), and ``max_priority`` bounds the priority its
requests may ask for, with a 400 that names the limit."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

import pytest

from loraplex.cli import main
from loraplex.platform import tenants
from loraplex.platform.db.models import Tenant
from tests.utils.tenancy import bearer

pytestmark = pytest.mark.anyio

COMPLETION = {"model": "tiny-chat", "prompt": "t30", "max_tokens": 2}
CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _count_pushes(env: Any) -> list[dict[str, float]]:
    """Every set_tenant_weights call the fake engine gets from now on."""
    pushes: list[dict[str, float]] = []
    forward = env.fake.set_tenant_weights

    async def spy(weights: Any) -> None:
        pushes.append(dict(weights))
        await forward(weights)

    env.fake.set_tenant_weights = spy
    return pushes


def _tenant_id(env: Any, name: str) -> str:
    with env.store.db.session() as session:
        tenant = tenants.require_tenant(session, name)
        return str(tenant.id)


async def test_create_and_patch_push_the_weights_to_the_engine(tenancy: Any) -> None:
    env = tenancy
    pushes = _count_pushes(env)
    r = await env.http.post(
        "/admin/api/tenants", headers=env.admin_headers, json={"name": "acme", "weight": 3}
    )
    assert r.status_code == 201, r.text
    assert (r.json()["weight"], r.json()["max_priority"]) == (3.0, 0)
    acme = _tenant_id(env, "acme")
    assert env.fake.tenant_weights == {acme: 3.0}

    r = await env.http.post("/admin/api/tenants", headers=env.admin_headers, json={"name": "b"})
    assert r.json()["weight"] == 1.0

    r = await env.http.patch(
        "/admin/api/tenants/acme", headers=env.admin_headers, json={"weight": 0.5}
    )
    assert r.status_code == 200 and r.json()["weight"] == 0.5
    assert env.fake.tenant_weights == {acme: 0.5, _tenant_id(env, "b"): 1.0}

    assert len(pushes) == 2  # acme's creation (weight 3) and the change; b's weight 1 was not
    r = await env.http.patch(
        "/admin/api/tenants/acme", headers=env.admin_headers, json={"display_name": "Acme"}
    )
    assert r.status_code == 200 and len(pushes) == 2  # no weight given, nothing sent

    events = (await env.http.get("/admin/api/audit", headers=env.admin_headers)).json()["data"]
    change = [e for e in events if e["action"] == "tenant.update"][-1]  # newest first
    assert change["before"]["weight"] == 3.0
    assert change["after"]["weight"] == 0.5


@pytest.mark.parametrize(
    ("field", "literal", "code"),  # the value as JSON text
    [
        ("weight", "0", "invalid_weight"),
        ("weight", "-1", "invalid_weight"),
        ("weight", "101", "invalid_weight"),
        ("weight", "5e-324", "invalid_weight"),  # the smallest float: a counter of +inf
        ("weight", "0.0099", "invalid_weight"),
        ("weight", "1" + "0" * 20, "invalid_weight"),
        ("weight", "1e309", "invalid_weight"),  # infinity once parsed
        ("weight", "true", None),
        ("weight", '"2"', None),
        ("max_priority", "1" + "0" * 20, "invalid_priority"),
        ("max_priority", "-1001", "invalid_priority"),
        ("max_priority", "1.5", None),
    ],
)
async def test_bad_scheduling_values_are_refused_with_the_range(
    tenancy: Any, field: str, literal: str, code: str | None
) -> None:
    env = tenancy
    env.tenant("known")
    headers = {**env.admin_headers, "Content-Type": "application/json"}
    for method, path, body in (
        ("POST", "/admin/api/tenants", f'{{"name": "acme", "{field}": {literal}}}'),
        ("PATCH", "/admin/api/tenants/known", f'{{"{field}": {literal}}}'),
    ):
        r = await env.http.request(method, path, headers=headers, content=body)
        assert r.status_code in (400, 422), (method, r.text)
        error = r.json()["error"]
        assert field in (error.get("param") or "") or field in error["message"], error
        if code is not None:
            limits = "from 0.01 to 100" if field == "weight" else "from -1000 to 1000"
            assert error["code"] == code and limits in error["message"], error
    assert env.fake.tenant_weights is None  # nothing reached the engine
    with env.store.db.session() as session:
        assert tenants.get_tenant(session, "acme") is None
        known = tenants.require_tenant(session, "known")
        assert (known.weight, known.max_priority) == (1.0, 0)


async def test_priority_below_the_tenants_limit_is_refused_naming_it(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme")
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        r = await env.http.post(path, headers=bearer(key), json={**body, "priority": -5})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "priority_not_allowed" and error["param"] == "priority"
        assert "max_priority" in error["message"] and "is 0" in error["message"]
    assert env.fake.submitted == []  # refused before the engine saw it

    r = await env.http.post(
        "/v1/completions", headers=bearer(key), json={**COMPLETION, "priority": 7}
    )
    assert r.status_code == 200, r.text
    assert env.fake.submitted[-1].priority == 7
    assert env.fake.submitted[-1].tenant == _tenant_id(env, "acme")

    # The operator lowers the limit: it applies from the next request, no restart.
    r = await env.http.patch(
        "/admin/api/tenants/acme", headers=env.admin_headers, json={"max_priority": -10}
    )
    assert r.status_code == 200 and r.json()["max_priority"] == -10
    r = await env.http.post("/v1/chat/completions", headers=bearer(key),
                            json={**CHAT, "priority": -10})  # fmt: skip
    assert r.status_code == 200, r.text
    assert env.fake.submitted[-1].priority == -10
    r = await env.http.post(
        "/v1/completions", headers=bearer(key), json={**COMPLETION, "priority": -11}
    )
    assert r.status_code == 400 and "is -10" in r.json()["error"]["message"]


async def test_priority_outside_the_protocol_range_is_a_400(tenancy: Any) -> None:
    env = tenancy
    key = env.tenant("acme")
    for value in (10**20, -(10**20), 1001, "high", 1.5):
        r = await env.http.post("/v1/completions", headers=bearer(key),
                                json={**COMPLETION, "priority": value})  # fmt: skip
        assert r.status_code == 400, (value, r.text)
        assert r.json()["error"]["param"] == "priority", r.text


async def test_the_lifespan_pushes_the_weights_and_picks_up_changes_made_on_the_database(
    tenancy: Any,
) -> None:
    env = tenancy
    env.tenant("acme")
    pushes = _count_pushes(env)
    service = env.app.platform.tenancy.tenants
    await service.push_weights()
    acme = _tenant_id(env, "acme")
    assert env.fake.tenant_weights == {acme: 1.0}

    with env.store.db.session() as session:  # as ``loraplex admin tenant update`` does
        session.get(Tenant, int(acme)).weight = 4.0  # type: ignore[union-attr]
    await service.push_weights(only_changed=True)
    assert env.fake.tenant_weights == {acme: 4.0} and len(pushes) == 2
    await service.push_weights(only_changed=True)  # unchanged: not sent again
    assert len(pushes) == 2


async def test_a_weight_set_from_the_cli_reaches_the_engine_within_the_refresh_interval(
    tenancy: Any,
) -> None:
    """What ``loraplex admin tenant update --weight`` tells the operator (issue 35): the command
    writes the database only; the server's refresh loop hands the new weight to the engine within
    its interval (WEIGHT_REFRESH_S in production, which the CLI prints; 0.2 s here)."""
    env = tenancy
    env.tenant("acme")
    acme = _tenant_id(env, "acme")
    service = env.app.platform.tenancy.tenants
    await service.push_weights()
    assert env.fake.tenant_weights == {acme: 1.0}
    assert (
        inspect.signature(service.refresh_weights_forever).parameters["interval_s"].default
        == tenants.WEIGHT_REFRESH_S
    )  # the interval the server runs it with
    loop = asyncio.create_task(service.refresh_weights_forever(interval_s=0.2))
    try:
        url = env.store.settings.resolved_database_url
        args = ["admin", "tenant", "update", "acme", "--weight", "4", "--database-url", url]
        assert await asyncio.to_thread(main, args) == 0  # the real command, on the same database
        start = time.monotonic()
        while env.fake.tenant_weights != {acme: 4.0}:
            assert time.monotonic() - start < 2.0, env.fake.tenant_weights
            await asyncio.sleep(0.02)
    finally:
        loop.cancel()
