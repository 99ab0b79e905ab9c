"""Issue 31: tenant weights are bounded (0.01 to 100). A row written before the range narrowed
(weights up to 1000, or any number above 0) reaches the engine clamped into the range, so one old
row cannot make the engine refuse every tenant's weight."""

from __future__ import annotations

from typing import Any

import pytest

from loraplex.platform import tenants

pytestmark = pytest.mark.anyio


async def test_old_rows_outside_the_range_reach_the_engine_clamped(tenancy: Any) -> None:
    env = tenancy
    env.tenant("heavy")
    env.tenant("light")
    with env.store.db.session() as session:  # as an earlier version could have stored them
        tenants.require_tenant(session, "heavy").weight = 1000.0
        tenants.require_tenant(session, "light").weight = 5e-324
        ids = {n: str(tenants.require_tenant(session, n).id) for n in ("heavy", "light")}
    r = await env.http.post(
        "/admin/api/tenants", headers=env.admin_headers, json={"name": "new", "weight": 2}
    )
    assert r.status_code == 201, r.text
    weights = env.fake.tenant_weights
    assert weights is not None
    assert (weights[ids["heavy"]], weights[ids["light"]]) == (100.0, 0.01)


async def test_a_deleted_tenants_weight_leaves_the_engine(tenancy: Any) -> None:
    env = tenancy
    for name, weight in (("acme", 3), ("globex", 2)):
        r = await env.http.post(
            "/admin/api/tenants", headers=env.admin_headers, json={"name": name, "weight": weight}
        )
        assert r.status_code == 201, r.text
    with env.store.db.session() as session:
        globex = str(tenants.require_tenant(session, "globex").id)
    r = await env.http.delete("/admin/api/tenants/acme", headers=env.admin_headers)
    assert r.status_code == 200, r.text
    assert env.fake.tenant_weights == {globex: 2.0}
