"""Who may reach which route: every route the app mounts belongs to exactly one audience.

=============  ==================================================  ============================
audience       who                                                 routes
=============  ==================================================  ============================
``public``     anyone, no credential                               /health, /version, sign-in,
                                                                   static files, the schema
``inference``  a tenant key with ``inference``, or the operator    /v1/models, completions,
                                                                   /tokenize, /detokenize
``tenant``     a tenant key only (never the operator's token)      /v1/adapters, /v1/usage
``operator``   the operator's credential only (the admin token;    /admin/api/*, vLLM's
               without the platform, the ``--api-key``), or an     /v1/load_lora_adapter and
               admin UI session's cookie (a viewer: reads only)    /v1/unload_lora_adapter
``metrics``    the metrics token or the operator                   /metrics
``admin_ui``   a signed-in operator session (cookie); API keys     /admin pages
               never open a page
=============  ==================================================  ============================

Routers are mounted only through :func:`mount`, which attaches the audience's guard to every
route of the router, so a route cannot be mounted without one; :func:`mounted_routes` reads it
back (the route-walking tests use it, so a new route cannot be forgotten). The guards are also
the routes' caller dependencies (FastAPI runs a dependency once per request), so routes ask for
``Depends(inference_caller)`` and the like, never for a looser check of their own.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Collection, Coroutine, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, iter_route_contexts
from starlette.routing import Mount, Route
from starlette.types import ASGIApp

from loraplex.platform.auth import (
    ANONYMOUS,
    SCOPE_ADAPTERS_WRITE,
    SCOPE_ADMIN,
    SCOPE_ADMIN_READ,
    SCOPE_INFERENCE,
    Caller,
    bearer_token,
)
from loraplex.platform.deps import get_platform
from loraplex.platform.errors import INVALID_REQUEST, PERMISSION, APIError
from loraplex.platform.keys import parse_key
from loraplex.platform.request_log import request_record

Audience = Literal["public", "inference", "tenant", "operator", "metrics", "admin_ui"]
AUDIENCES: tuple[Audience, ...] = get_args(Audience)
# What an operator owns: a tenant's credential reaches none of these.
OPERATOR_AUDIENCES: frozenset[Audience] = frozenset({"operator", "metrics", "admin_ui"})
_PUBLIC_MOUNT = "public:"  # the name prefix of mounted apps anyone may read (static files)


# ---- who is calling ----------------------------------------------------------------------------


async def get_caller(request: Request) -> Caller:
    """The authenticated caller (the platform's ``Authenticator`` decides), once per request."""
    caller = await get_platform(request).authenticator.authenticate(request)
    request.state.caller = caller
    return caller


def require_scope(scope: str) -> Callable[[Request], Coroutine[Any, Any, Caller]]:
    """A dependency: the caller, who must hold ``scope`` (else 403). Routes use the audience
    guards below; this is for a check of its own (tests)."""

    async def dependency(request: Request) -> Caller:
        caller = await get_caller(request)
        _require_scope(caller, scope)
        return caller

    return dependency


# ---- the guards --------------------------------------------------------------------------------


async def public(request: Request) -> None:
    """No credential needed."""


async def inference_caller(request: Request) -> Caller:
    caller = await get_caller(request)
    _require_scope(caller, SCOPE_INFERENCE)
    return caller


async def tenant_caller(request: Request) -> Caller:
    caller = await get_caller(request)
    if caller.kind != "tenant":
        raise APIError(
            403,
            f"{request.url.path} serves tenants and takes a tenant's API key (lpx_...), not "
            "the operator's credential; the operator manages tenants under /admin/api.",
            type=PERMISSION,
            code="tenant_key_required",
        )
    return caller


async def tenant_writer(caller: Annotated[Caller, Depends(tenant_caller)]) -> Caller:
    """A tenant key that may change the tenant's adapters."""
    _require_scope(caller, SCOPE_ADAPTERS_WRITE)
    return caller


async def operator_caller(request: Request) -> Caller:
    caller = await _operator_credential(request)
    if caller.kind == "operator" and caller.has_scope(SCOPE_ADMIN):
        return caller
    if caller.kind == "operator" and caller.has_scope(SCOPE_ADMIN_READ):
        if request.method in _READ_METHODS:
            return caller
        raise APIError(
            403,
            f"{request.method} {request.url.path} changes something, and you are signed in with "
            "the viewer role, which is read-only; ask an operator to make the change.",
            type=PERMISSION,
            code="read_only_role",
        )
    raise _not_operator(request.url.path)


_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SessionCaller = Callable[[Request], Coroutine[Any, Any, Caller | None]]


async def _operator_credential(request: Request) -> Caller:
    """The bearer credential as everywhere; without an ``Authorization`` header, the admin UI
    session of the request's cookie when the application has one (``app.admin_session``:
    operators and viewers signed in to the UI, see ``loraplex.webui.api_session``)."""
    hook: SessionCaller | None = getattr(request.app, "admin_session", None)
    if hook is not None and "authorization" not in request.headers:
        caller = await hook(request)
        if caller is not None:
            request.state.caller = caller
            return caller
    return await get_caller(request)


def _not_operator(path: str) -> APIError:
    return APIError(
        403,
        f"{path} is the operator's: it takes the admin token, and a tenant's API key never "
        "reaches it (it lacks the 'admin' scope).",
        type=PERMISSION,
        code="insufficient_scope",
    )


async def scraper(request: Request) -> None:
    """``Authorization: Bearer <metrics token>``, or the operator's credential (with a metrics
    token set, an open server's anonymous callers are not accepted). 401 otherwise; 403 for a
    tenant's key."""
    secret = get_platform(request).settings.metrics_token
    expected = secret.get_secret_value().encode() if secret is not None else None
    token = bearer_token(request)
    if (
        expected is not None
        and token is not None
        and hmac.compare_digest(token.encode("utf-8", "surrogatepass"), expected)
    ):
        request_record(request).caller = "metrics"
        return
    try:
        caller = await get_caller(request)
    except APIError as exc:
        if exc.status != 401:
            raise
        raise _scrape_unauthorized(exc.code or "invalid_api_key") from None
    if expected is not None and caller.id == ANONYMOUS:
        raise _scrape_unauthorized("missing_api_key" if token is None else "invalid_api_key")
    request_record(request).caller = caller.id
    if caller.kind != "operator" or not caller.has_scope(SCOPE_ADMIN):
        raise _not_operator(request.url.path)


async def admin_ui(request: Request) -> None:
    """The admin UI's pages: their guard is their session dependency (checked by
    :func:`mount`), which answers a missing session itself (a redirect to sign in, 401 for the
    scripts' polls, 403 for a form). API keys never open a page; a tenant's key sent to one is
    refused outright (403), whatever session the request also carries."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() == "bearer" and parse_key(token.strip()) is not None:
        raise APIError(
            403,
            f"{request.url.path} is a page of the operator's admin UI; a tenant's API key never "
            "opens it. Tenants use the API under /v1.",
            type=PERMISSION,
            code="operator_only",
        )


_GUARDS: dict[Audience, Callable[..., Any]] = {
    "public": public,
    "inference": inference_caller,
    "tenant": tenant_caller,
    "operator": operator_caller,
    "metrics": scraper,
    "admin_ui": admin_ui,
}
_AUDIENCE_OF_GUARD: dict[Callable[..., Any], Audience] = {g: a for a, g in _GUARDS.items()}


# For routes: ``caller: InferenceCaller`` and so on (the same dependency as the audience's
# guard, so it runs once per request).
InferenceCaller = Annotated[Caller, Depends(inference_caller)]
TenantCaller = Annotated[Caller, Depends(tenant_caller)]
TenantWriter = Annotated[Caller, Depends(tenant_writer)]
OperatorCaller = Annotated[Caller, Depends(operator_caller)]


def _require_scope(caller: Caller, scope: str) -> None:
    if not caller.has_scope(scope):
        raise APIError(
            403,
            f"This API key may not do this (it lacks the '{scope}' scope); use a key that has it.",
            type=PERMISSION,
            code="insufficient_scope",
        )


def _scrape_unauthorized(code: str) -> APIError:
    return APIError(
        401,
        "GET /metrics needs the metrics token (--metrics-token) or the admin token, sent as "
        "'Authorization: Bearer <token>'.",
        type=INVALID_REQUEST,
        code=code,
        headers={"WWW-Authenticate": "Bearer"},
    )


# ---- mounting ----------------------------------------------------------------------------------


def mount(
    app: FastAPI,
    router: APIRouter,
    audience: Audience,
    *,
    session_guards: Collection[Callable[..., Any]] = (),
) -> None:
    """Include ``router`` with ``audience``'s guard on every route. The admin UI's routes must
    each depend on one of ``session_guards`` (else this raises: a page without its check is a
    bug found at start-up, not in production)."""
    if audience == "admin_ui":
        guards = set(session_guards)
        if not guards:
            raise ValueError("the admin UI's routes need session_guards")
        for route in router.routes:
            if isinstance(route, APIRoute) and not guards & set(_calls(route.dependant)):
                raise RuntimeError(
                    f"admin UI route {route.path} has no session check; depend on one of "
                    f"{sorted(g.__name__ for g in guards)}"
                )
    app.include_router(router, dependencies=[Depends(_GUARDS[audience])])


def mount_public_files(app: FastAPI, path: str, files: ASGIApp, name: str) -> None:
    """Mount static files anyone may read (the admin UI's CSS and scripts)."""
    app.mount(path, files, name=_PUBLIC_MOUNT + name)


@dataclass(frozen=True)
class MountedRoute:
    path: str
    methods: frozenset[str]  # empty for a mounted app (static files)
    audience: Audience | None  # None: mounted around :func:`mount` (a bug)
    mounted_app: bool = False


def mounted_routes(app: FastAPI) -> list[MountedRoute]:
    """Every route ``app`` serves, with the audience it was mounted for."""
    out = []
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        path = str(context.path or "")
        if isinstance(route, Mount):
            public_files = (route.name or "").startswith(_PUBLIC_MOUNT)
            out.append(MountedRoute(path, frozenset(), "public" if public_files else None, True))
            continue
        methods = frozenset(context.methods or ()) - {"HEAD"}
        dependant = getattr(context, "dependant", None)
        audience: Audience | None = None
        if isinstance(dependant, Dependant):
            found = {_AUDIENCE_OF_GUARD[c] for c in _calls(dependant) if c in _AUDIENCE_OF_GUARD}
            audience = found.pop() if len(found) == 1 else None  # exactly one guard
        elif isinstance(route, Route) and path == app.openapi_url:
            audience = "public"  # FastAPI's own schema route
        out.append(MountedRoute(path, methods, audience))
    return out


def _calls(dependant: Dependant) -> Iterator[Callable[..., Any]]:
    for dep in dependant.dependencies:
        if dep.call is not None:
            yield dep.call
        yield from _calls(dep)
