"""Budgets and prices given numbers too large for a float (a JSON integer of 400 digits): a 400
naming the field, as for any number out of range, not a 500 (``math.isfinite`` raised
OverflowError on such an int)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.anyio

HUGE = b"1" + b"0" * 400  # a JSON integer; Python reads it as an int no float holds


async def test_numbers_past_a_float_are_a_400_naming_the_field(tenancy: Any) -> None:
    env = tenancy
    env.tenant("acme")
    headers = {**env.admin_headers, "content-type": "application/json"}
    cases = [
        ("POST", "/admin/api/tenants/acme/budgets", "limit",
         b'{"metric": "tokens", "period": "day", "limit": %s}'),
        ("POST", "/admin/api/tenants/acme/budgets", "prompt_weight",
         b'{"metric": "tokens", "period": "day", "limit": 5, "prompt_weight": %s}'),
        ("PUT", "/admin/api/prices/models/tiny-chat", "prompt_per_million",
         b'{"prompt_per_million": %s, "completion_per_million": 1}'),
    ]  # fmt: skip
    for method, path, param, body in cases:
        r = await env.http.request(method, path, headers=headers, content=body % HUGE)
        assert r.status_code == 400, (param, r.status_code, r.text[:200])
        error = r.json()["error"]
        assert error["param"] == param and len(error["message"]) < 300, error
