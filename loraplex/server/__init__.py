"""The composition root: the one place that puts the engine client, the platform's components
and the admin UI together into the FastAPI application.

    create_app(client, settings, store=...)       -> LoraplexApp
      Platform.build(client, settings, store)       components, by constructors
      build_webui(platform)                         the admin UI's state (with a store)
      middleware: body limit, request log           observers: platform's + the UI's charts
      mount_routes(app)                             every router with its audience (``access``)
      lifespan                                      the platform's (engine, usage retention)

Only this package imports both ``loraplex.platform`` and ``loraplex.webui`` (and the engine's
factories): the platform never imports the UI, nor the UI the engine beyond its client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI

from loraplex.engine.client import EngineClient
from loraplex.platform import access
from loraplex.platform.access import Audience
from loraplex.platform.api import admin as admin_api
from loraplex.platform.api import budgets as budgets_api
from loraplex.platform.api import metrics as metrics_api
from loraplex.platform.api import openai as openai_routes
from loraplex.platform.api import registry as registry_routes
from loraplex.platform.api import request_logs as request_logs_api
from loraplex.platform.api import tokenize as tokenize_routes
from loraplex.platform.api import usage as usage_api
from loraplex.platform.api import webhooks as webhooks_api
from loraplex.platform.auth import Authenticator
from loraplex.platform.components import Platform
from loraplex.platform.errors import document_error_envelope, install_error_handlers
from loraplex.platform.registry.upload import streams_own_body
from loraplex.platform.request_log import BodyLimitMiddleware, RequestLogMiddleware
from loraplex.platform.settings import ServerSettings, load_settings
from loraplex.platform.store import Store
from loraplex.webui import ROUTERS, SESSION_GUARDS, WebUI, WebUISettings, attach_webui, build_webui
from loraplex.webui.api_session import session_caller

__all__ = ["LoraplexApp", "create_app", "mount_routes"]


class LoraplexApp(FastAPI):
    """The application: FastAPI with the platform's components (``deps`` reads them) and the
    admin UI's state (None without the platform)."""

    platform: Platform
    webui: WebUI | None
    admin_session: access.SessionCaller | None  # an admin UI session on /admin/api


def create_app(
    client: EngineClient,
    settings: ServerSettings | None = None,
    *,
    store: Store | None = None,
    own_client: bool = False,
    tokenizer: Any | None = None,
    authenticator: Authenticator | None = None,
    webui_settings: WebUISettings | None = None,
) -> LoraplexApp:
    """The app serving ``client``: the single-operator server, or with ``store`` (the
    platform's database and files) the multi-tenant platform with its admin API and UI.

    ``own_client``: the app's lifespan starts the client and shuts it down (``uvicorn.run``);
    otherwise the caller starts it before serving. ``tokenizer``: the base model's (default:
    loaded from the engine's model directory). ``authenticator``: replaces the default one.
    """
    settings = settings or load_settings()
    platform = Platform.build(
        client, settings, store=store, tokenizer=tokenizer, authenticator=authenticator
    )
    webui = build_webui(platform, webui_settings) if store is not None else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with platform.lifespan(own_client=own_client):
            yield

    app = LoraplexApp(
        title="loraplex",
        summary="OpenAI-compatible multi-LoRA inference",
        lifespan=lifespan,
        docs_url=None,  # Swagger UI loads from a CDN; the platform serves no third-party assets
        redoc_url=None,
    )
    app.platform, app.webui = platform, webui
    app.admin_session = session_caller if webui is not None else None
    install_error_handlers(app)
    document_error_envelope(app)
    observers = platform.observers
    if webui is not None:
        attach_webui(app)
        observers += (webui.recorder.observe_record,)
    # Outermost last: the request log wraps the body limit, so a 413 is logged (and counted) too.
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=settings.max_request_bytes, exempt=streams_own_body
    )
    app.add_middleware(RequestLogMiddleware, observers=observers, body_cap=platform.body_cap)
    mount_routes(app)
    return app


def mount_routes(app: LoraplexApp) -> None:
    """Every route of the app, each router with its audience (see ``access``): the one place
    that says which kind of caller reaches what. vLLM's LoRA load/unload endpoints are the
    operator's everywhere (its ``--api-key``, or the platform's admin token); tenants' adapters
    come through the registry."""
    table: list[tuple[APIRouter, Audience]] = [
        (openai_routes.public_router, "public"),
        (openai_routes.inference_router, "inference"),
        (tokenize_routes.router, "inference"),
        (metrics_api.router, "metrics"),
        (openai_routes.operator_lora_router, "operator"),
    ]
    if app.platform.tenancy is not None:
        table += [
            (registry_routes.tenant_router, "tenant"),
            (usage_api.router, "tenant"),
            (budgets_api.tenant_router, "tenant"),
            (budgets_api.operator_router, "operator"),
            (request_logs_api.operator_router, "operator"),
            (registry_routes.operator_router, "operator"),
            (admin_api.router, "operator"),
            (webhooks_api.router, "operator"),
        ]
    if app.webui is not None:
        table += ROUTERS
    for router, audience in table:
        access.mount(app, router, audience, session_guards=SESSION_GUARDS)
