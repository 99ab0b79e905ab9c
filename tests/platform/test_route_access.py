"""Every route the app mounts, walked with every kind of credential.

Each route must have been mounted for one audience (``access.audience_of``), so a new route that
skips ``access.mount`` fails here. Then each route and method is called without a credential,
with a tenant's key (every tenant scope), with the operator's credential and with the metrics
token: a tenant's key is refused (403/404) on every operator route, the operator's credential on
every tenant-only route, and nobody passes without a credential where one is needed.

"Refused" means 401, 403 or 404, or the admin UI's redirect to its sign-in page; "reached" means
the route ran past its guard: any answer but 401 and 403 (a 404 for a missing tenant, a 400 for
an empty body, and so on), never a 5xx.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI

from loraplex.platform import access
from loraplex.platform.settings import ServerSettings
from loraplex.server import create_app
from loraplex.webui.context import SESSION_COOKIE
from loraplex.webui.credentials import sso_version
from loraplex.webui.oidc import OIDCClient
from tests.utils import oidc
from tests.utils.fakes import FakeEngineClient
from tests.utils.oidc import needs_provider
from tests.utils.tenancy import TenancyEnv, bearer, tenancy_env

pytestmark = pytest.mark.anyio

METRICS_TOKEN = "metrics-token-0123456789abcdef"
OPERATOR_KEY = "sk-operator-key-0123456789"
PARAMS = {"tenant": "nobody", "ref": "nothing", "public_id": "nokey", "name": "nothing"}
NOT_REACHED = (401, 403)


@dataclass(frozen=True)
class Probe:
    method: str
    path: str  # with its parameters filled in
    template: str
    audience: access.Audience


def probes(app: FastAPI) -> Iterator[Probe]:
    """One probe per mounted route and method; fails on a route mounted without an audience."""
    for route in access.mounted_routes(app):
        assert route.audience is not None, f"{route.path!r} was mounted without access.mount"
        if route.mounted_app:
            yield Probe("GET", f"{route.path}/app.css", route.path, route.audience)
            continue
        filled = re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: PARAMS.get(m.group(1), "x"), route.path)
        for method in sorted(route.methods or {"GET"}):
            yield Probe(method, filled, route.path, route.audience)


async def call(http: httpx.AsyncClient, probe: Probe, headers: dict[str, str]) -> httpx.Response:
    body = None if probe.method == "GET" else {}
    return await http.request(probe.method, probe.path, headers=headers, json=body)


def refused(response: httpx.Response) -> bool:
    if response.status_code in (401, 403, 404):
        return True
    return response.status_code == 303 and "/admin/login" in response.headers.get("location", "")


def reached(response: httpx.Response) -> bool:
    return response.status_code not in NOT_REACHED and response.status_code < 500


@pytest.fixture
async def platform_env(
    tmp_path: Path, fake: FakeEngineClient, tokenizer: Any
) -> AsyncIterator[TenancyEnv]:
    server = ServerSettings(metrics_token=METRICS_TOKEN)
    async with tenancy_env(tmp_path, fake, tokenizer, server=server) as env:
        yield env


async def test_every_platform_route_is_reached_only_by_its_audience(
    platform_env: TenancyEnv,
) -> None:
    env = platform_env
    tenant = env.tenant("acme")
    all_probes = list(probes(env.app))
    audiences = {p.audience for p in all_probes}
    assert audiences == set(access.AUDIENCES), audiences  # every kind of route is walked
    seen: dict[str, list[str]] = {}
    # Credentials that must be refused first: the operator's probes below change state.
    for probe in all_probes:
        nobody = await call(env.http, probe, {})
        as_tenant = await call(env.http, probe, bearer(tenant))
        where = f"{probe.method} {probe.template}"
        seen.setdefault(probe.audience, []).append(where)
        if probe.audience in access.OPERATOR_AUDIENCES:
            assert as_tenant.status_code in (403, 404), (where, as_tenant.status_code)
            assert refused(nobody), (where, nobody.status_code)
        elif probe.audience == "tenant":
            assert reached(as_tenant), (where, as_tenant.status_code, as_tenant.text)
            assert refused(nobody), (where, nobody.status_code)
        elif probe.audience == "inference":
            assert reached(as_tenant), (where, as_tenant.status_code, as_tenant.text)
            assert nobody.status_code == 401, (where, nobody.status_code)
        else:  # public: no credential asked (the sign-in form checks its CSRF token: 403)
            assert nobody.status_code != 401 and nobody.status_code < 500, (where, nobody.text)
    for probe in all_probes:
        where = f"{probe.method} {probe.template}"
        as_admin = await call(env.http, probe, env.admin_headers)
        if probe.audience == "tenant":
            assert as_admin.status_code == 403, (where, as_admin.status_code)
            assert as_admin.json()["error"]["code"] == "tenant_key_required"
        elif probe.audience == "admin_ui":
            assert refused(as_admin), (where, as_admin.status_code)  # pages need a session
        elif probe.audience == "public":
            assert as_admin.status_code != 401 and as_admin.status_code < 500, where
        else:
            assert reached(as_admin), (where, as_admin.status_code, as_admin.text)
        if probe.audience == "metrics":
            scraped = await call(env.http, probe, bearer(METRICS_TOKEN))
            assert scraped.status_code == 200, scraped.text
    # The route sets, as they stand: a change here is a change of who may do what.
    assert sorted(seen["tenant"]) == [
        "DELETE /v1/adapters/{ref}",
        "GET /v1/adapters",
        "GET /v1/adapters/{ref}",
        "GET /v1/budgets",
        "GET /v1/usage",
        "POST /v1/adapters",
    ]
    assert sorted(seen["inference"]) == [
        "GET /v1/models",
        "GET /v1/models/{name:path}",
        "POST /detokenize",
        "POST /tokenize",
        "POST /v1/chat/completions",
        "POST /v1/completions",
    ]
    vllm_adapter_api = ["POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter"]
    assert sorted(w for w in seen["operator"] if w.split(" ", 1)[1].startswith("/v1/")) == (
        vllm_adapter_api
    )
    assert all(
        w.split(" ", 1)[1].startswith("/admin/api/")
        for w in seen["operator"]
        if w not in vllm_adapter_api
    )
    assert seen["metrics"] == ["GET /metrics"]


async def test_a_tenant_key_never_reaches_the_operator_lora_endpoints(
    platform_env: TenancyEnv,
) -> None:
    """vLLM's adapter API is on the platform for the admin token only: a tenant's key (every
    scope) gets 403 before the body is read, and the answer names no path of the server."""
    env = platform_env
    tenant = env.tenant("acme")
    for path, body in (
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}),
        ("/v1/unload_lora_adapter", {"lora_name": "x"}),
    ):
        r = await env.http.post(path, json=body, headers=bearer(tenant))
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "insufficient_scope"
        assert "/etc" not in r.text and "adapter_config" not in r.text


async def test_every_route_without_the_platform_needs_the_operator_key(
    fake: FakeEngineClient, tokenizer: Any
) -> None:
    app = create_app(
        fake,
        ServerSettings(api_key=OPERATOR_KEY, metrics_token=METRICS_TOKEN),
        tokenizer=tokenizer,
    )
    transport = httpx.ASGITransport(app=app)
    audiences: dict[str, str] = {}
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        for probe in probes(app):
            audiences[f"{probe.method} {probe.template}"] = probe.audience
            nobody = await call(http, probe, {})
            wrong = await call(http, probe, bearer("lpx_abc_" + "x" * 30))
            operator = await call(http, probe, bearer(OPERATOR_KEY))
            where = f"{probe.method} {probe.template}"
            assert reached(operator), (where, operator.status_code, operator.text)
            if probe.audience == "public":
                assert nobody.status_code != 401 and nobody.status_code < 500, where
            else:
                assert nobody.status_code == 401 and wrong.status_code == 401, where
    assert audiences["POST /v1/load_lora_adapter"] == "operator"
    assert audiences["POST /v1/unload_lora_adapter"] == "operator"
    assert not any(a in ("tenant", "admin_ui") for a in audiences.values())


def test_a_route_mounted_around_access_is_found(fake: FakeEngineClient) -> None:
    """The walk above fails on a route added without ``access.mount``, directly or through a
    plain ``include_router``, and on one mounted under two audiences."""

    async def sneaky() -> dict[str, str]:
        return {}

    for how in ("route", "router", "two guards"):
        app = create_app(fake, ServerSettings())
        router = APIRouter()
        router.add_api_route("/v1/sneaky", sneaky)
        if how == "route":
            app.add_api_route("/v1/sneaky", sneaky)
        elif how == "router":
            app.include_router(router)
        else:
            router.add_api_route(
                "/v1/sneakier", sneaky, dependencies=[Depends(access.tenant_caller)]
            )
            access.mount(app, router, "inference")
        found = [r for r in access.mounted_routes(app) if r.path.startswith("/v1/sneak")]
        assert found and all(r.audience is None for r in found[-1:]), (how, found)
        with pytest.raises(AssertionError, match=r"without access\.mount"):
            list(probes(app))


@needs_provider
async def test_with_sso_a_viewer_reads_and_never_writes_and_no_tenant_key_gets_in(
    platform_env: TenancyEnv,
) -> None:
    """Single sign-on configured against a real provider: its routes (sign-in start, callback,
    sign-out) are in the walk; a viewer's session cookie reaches every operator route's reads
    and no write (403 read_only_role), every admin page's GET and no form POST but signing
    out; a tenant's key with the same cookie is still refused on every operator route."""
    env = platform_env
    assert env.app.webui is not None
    tenant = env.tenant("acme")
    with oidc.provider(["http://test/admin/sso/callback"]) as idp:
        env.app.webui.sso = OIDCClient(oidc.sso_settings(idp.issuer, "http://localhost"))
        fingerprint = env.app.webui.sso.settings.fingerprint()
        session_id, _ = await env.app.webui.sessions.open(sso_version("viewer", fingerprint, "bob"))
        viewer = {"Cookie": f"{SESSION_COOKIE}={session_id}"}
        all_probes = list(probes(env.app))
        wheres = {f"{p.method} {p.template}": p.audience for p in all_probes}
        assert wheres["GET /admin/sso/login"] == "public"
        assert wheres["GET /admin/sso/callback"] == "public"
        assert wheres["POST /admin/logout"] == "public"  # its own session check (any role)
        writes = [p for p in all_probes if p.method not in ("GET", "HEAD")]
        for probe in all_probes:
            where = f"{probe.method} {probe.template}"
            as_tenant = await call(env.http, probe, {**viewer, **bearer(tenant)})
            as_viewer = await call(env.http, probe, viewer)
            if probe.audience == "operator":
                assert as_tenant.status_code in (403, 404), (where, as_tenant.status_code)
                if probe in writes:
                    assert as_viewer.status_code == 403, (where, as_viewer.status_code)
                    assert as_viewer.json()["error"]["code"] == "read_only_role", where
                else:
                    assert reached(as_viewer), (where, as_viewer.status_code, as_viewer.text)
            elif probe.audience == "admin_ui":
                assert as_tenant.status_code == 403, (where, as_tenant.status_code)
                if probe in writes:  # no CSRF token here; with one, test_sso's viewer test
                    assert as_viewer.status_code == 403, (where, as_viewer.status_code)
                else:
                    assert reached(as_viewer) and as_viewer.status_code != 303, where
            elif probe.audience == "metrics":
                assert refused(as_viewer), (where, as_viewer.status_code)
            elif probe.template.startswith("/admin/sso/"):
                assert as_viewer.status_code in (303, 400), (where, as_viewer.text)
            elif probe.template == "/admin/logout":  # without the form's CSRF token
                assert as_viewer.status_code == 403, where
        form = await env.http.get("/admin", headers=viewer)
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
        assert csrf is not None
        out = await env.http.post(
            "/admin/logout", data={"csrf_token": csrf.group(1)}, headers=viewer
        )
        assert out.status_code == 303 and "signed_out" in out.headers["location"]
        assert (await env.http.get("/admin/api/tenants", headers=viewer)).status_code == 401
