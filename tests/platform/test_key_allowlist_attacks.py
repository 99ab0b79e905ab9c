"""A key's model list as an attacker would send it: a body of many thousands of names (a few
hundred kilobytes, far under the request body limit) is refused at once, not after comparing
every name with every other one (which held the admin request, and its database transaction,
for seconds here and for most of an hour at the 4 MiB body limit)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from loraplex.platform.model_access import MAX_ALLOWED_MODELS

pytestmark = pytest.mark.anyio


async def test_a_huge_allowed_models_list_is_refused_at_once(tenancy: Any) -> None:
    env = tenancy
    env.tenant("acme")
    names = [f"m{i}" for i in range(20_000)]  # ~180 KB of JSON
    for method, path in (
        ("POST", "/admin/api/tenants/acme/keys"),
        ("PATCH", "/admin/api/tenants/acme/keys/" + await _key_id(env)),
    ):
        start = time.perf_counter()
        r = await env.http.request(
            method, path, headers=env.admin_headers, json={"allowed_models": names}
        )
        took = time.perf_counter() - start
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_allowed_models" and error["param"] == "allowed_models"
        assert f"at most {MAX_ALLOWED_MODELS}" in error["message"]
        assert took < 1.0, f"{method} took {took:.2f} s to refuse the list"


async def _key_id(env: Any) -> str:
    r = await env.http.get("/admin/api/tenants/acme/keys", headers=env.admin_headers)
    assert r.status_code == 200, r.text
    return str(r.json()["data"][0]["id"])
