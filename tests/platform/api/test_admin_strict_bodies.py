"""Every admin API body refuses fields it does not know: a 400 naming each of them, the fields
the body takes and, for a misplaced quota, where it belongs; and nothing changes.

The walk finds the routes itself (every operator route under /admin/api that takes a body), so
a new admin route with a body that drops unknown fields fails here. The operator's vLLM routes
(/v1/load_lora_adapter, ...) are not the admin API: they keep vLLM's own request bodies.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from loraplex.platform import access
from loraplex.platform.api.bodies import StrictBody
from tests.utils.fakes import FakeEngineClient
from tests.utils.tenancy import TenancyEnv, tenancy_env

pytestmark = pytest.mark.anyio

UNKNOWN = {"bogus_field": 1, "another_bogus": "x"}
# Operator routes that take no JSON body: the multipart upload (checked below) and a bodiless
# POST. A new route here must be looked at: does it read fields from somewhere?
NOT_JSON = {
    "POST /admin/api/tenants/{tenant}/adapters",  # multipart
    "POST /admin/api/tenants/{tenant}/adapters/{name}/versions/{number}/retry",  # no body
    "POST /admin/api/webhooks/{webhook_id}/test",  # no body
}


@pytest.fixture
async def env(tmp_path: Path, fake: FakeEngineClient, tokenizer: Any) -> AsyncIterator[TenancyEnv]:
    async with tenancy_env(tmp_path, fake, tokenizer) as env:
        yield env


def _error(response: Any) -> dict[str, Any]:
    assert response.status_code == 400, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    return dict(error)


def _json_body_routes(env: TenancyEnv) -> set[str]:
    """``METHOD template`` of every route whose schema has a JSON request body."""
    found = set()
    for path, methods in env.app.openapi()["paths"].items():
        for method, operation in methods.items():
            if "application/json" in operation.get("requestBody", {}).get("content", {}):
                found.add(f"{method.upper()} {path}")
    return found


async def test_every_admin_body_refuses_unknown_fields_naming_them(env: TenancyEnv) -> None:
    env.tenant("acme")
    json_routes = _json_body_routes(env)
    walked = []
    for route in access.mounted_routes(env.app):
        if route.audience != "operator" or not route.path.startswith("/admin/api/"):
            continue
        for method in sorted(route.methods & {"POST", "PUT", "PATCH"}):
            where = f"{method} {route.path}"
            if where in NOT_JSON:
                continue
            assert where in json_routes, f"{where} takes no JSON body: add it to NOT_JSON"
            path = re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: {"tenant": "acme"}.get(m[1], "x"),
                          route.path)  # fmt: skip
            r = await env.http.request(method, path, headers=env.admin_headers, json=UNKNOWN)
            error = _error(r)
            assert "'bogus_field'" in error["message"] and "'another_bogus'" in error["message"]
            assert "in the request body: they would change nothing; remove them" in error["message"]
            assert error["param"] == "bogus_field", (where, error)
            walked.append(where)
    assert sorted(walked) == [
        "PATCH /admin/api/tenants/{tenant}",
        "PATCH /admin/api/tenants/{tenant}/budgets/{budget_id}",
        "PATCH /admin/api/tenants/{tenant}/keys/{public_id}",
        "POST /admin/api/tenants",
        "POST /admin/api/tenants/{tenant}/budgets",
        "POST /admin/api/tenants/{tenant}/keys",
        "POST /admin/api/webhooks",
        "PUT /admin/api/prices/models/{name}",
        "PUT /admin/api/tenants/{tenant}/adapters/{ref}/price",
        "PUT /admin/api/tenants/{tenant}/request-log",
    ]
    # Every body schema says so too, nested ones included.
    schemas = env.app.openapi()["components"]["schemas"]
    for name in ("TenantCreate", "TenantUpdate", "QuotasBody", "KeyCreate", "KeyUpdate",
                 "WebhookCreate"):  # fmt: skip
        assert schemas[name]["additionalProperties"] is False, name


def test_every_admin_body_model_is_strict() -> None:
    from loraplex.platform.api import admin, webhooks

    bodies = [admin.TenantCreate, admin.TenantUpdate, admin.QuotasBody, admin.KeyCreate,
              admin.KeyUpdate, webhooks.WebhookCreate]  # fmt: skip
    assert all(issubclass(b, StrictBody) for b in bodies)


async def test_a_quota_beside_quotas_is_refused_and_says_where_it_goes(env: TenancyEnv) -> None:
    """Issue 34's first example: this answered 201 and created a tenant with no limit."""
    r = await env.http.post(
        "/admin/api/tenants",
        headers=env.admin_headers,
        json={"name": "globex", "requests_per_minute": 2},
    )
    error = _error(r)
    assert error["param"] == "requests_per_minute"
    assert "Unknown field 'requests_per_minute'" in error["message"]
    assert '{"quotas": {"requests_per_minute": 2}}' in error["message"]
    missing = await env.http.get("/admin/api/tenants/globex", headers=env.admin_headers)
    assert missing.status_code == 404  # nothing was created


async def test_a_short_quota_name_is_refused_on_patch_and_nothing_changes(
    env: TenancyEnv,
) -> None:
    """Issue 34's second example: this answered 200 and changed nothing."""
    created = await env.http.post(
        "/admin/api/tenants", headers=env.admin_headers, json={"name": "globex"}
    )
    assert created.status_code == 201, created.text
    r = await env.http.patch("/admin/api/tenants/globex", headers=env.admin_headers,
                             json={"rpm": 2})  # fmt: skip
    error = _error(r)
    assert error["param"] == "rpm"
    assert '{"quotas": {"requests_per_minute": 2}}' in error["message"]
    # Inside quotas, the short name is refused too, and the full name is offered.
    r = await env.http.patch("/admin/api/tenants/globex", headers=env.admin_headers,
                             json={"quotas": {"rpm": 2}})  # fmt: skip
    error = _error(r)
    assert error["param"] == "quotas.rpm" and "write 'requests_per_minute'" in error["message"]
    assert "The fields of 'quotas' are: requests_per_minute, tokens_per_minute" in error["message"]
    after = await env.http.get("/admin/api/tenants/globex", headers=env.admin_headers)
    assert after.json() == created.json()  # unchanged, updated_at included
    audit = await env.http.get("/admin/api/audit?action=tenant.update", headers=env.admin_headers)
    assert audit.json()["data"] == []


async def test_the_admin_upload_refuses_unknown_form_fields(env: TenancyEnv) -> None:
    env.tenant("acme")
    r = await env.http.post(
        "/admin/api/tenants/acme/adapters",
        headers=env.admin_headers,
        files={"files": ("adapter_config.json", b"{}", "application/json")},
        data={"name": "bot", "tenant": "other", "owner": "x"},
    )
    error = _error(r)
    assert error["param"] == "tenant"
    assert "'tenant', 'owner'" in error["message"] and "name, description" in error["message"]
    listed = await env.http.get("/admin/api/tenants/acme/adapters", headers=env.admin_headers)
    assert listed.json()["data"] == []


async def test_the_docs_show_each_admin_body_once(env: TenancyEnv) -> None:
    """Issue 34.6: the docs show each admin request body once, in the table of
    docs/operations/platform.md (issue 35 moved it there from the README)."""
    doc = Path(__file__).resolve().parents[3] / "docs" / "operations" / "platform.md"
    readme = doc.read_text()
    short = {"tenant": "t", "public_id": "id", "number": "n"}
    for route in access.mounted_routes(env.app):
        if route.audience != "operator" or not route.path.startswith("/admin/api/"):
            continue
        for method in sorted(route.methods & {"POST", "PUT", "PATCH"}):
            path = re.sub(r"\{(\w+)\}", lambda m: "{" + short.get(m[1], m[1]) + "}", route.path)
            row = f"| `{method} {path}` |"
            assert readme.count(row) == 1, f"{doc.name}'s admin body table needs one {row!r} row"
