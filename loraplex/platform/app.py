"""``create_app(client, settings)``: the FastAPI application around an ``EngineClient``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from loraplex.engine.client import EngineClient
from loraplex.platform import access
from loraplex.platform.access import Audience
from loraplex.platform.auth import Authenticator, OperatorKeyAuthenticator
from loraplex.platform.errors import document_error_envelope, install_error_handlers
from loraplex.platform.metrics import PlatformMetrics
from loraplex.platform.metrics import router as metrics_router
from loraplex.platform.model_resolver import ModelResolver
from loraplex.platform.openai import routes as openai_routes
from loraplex.platform.openai.serving import OpenAIServing, ServingConfig
from loraplex.platform.registry.upload import streams_own_body
from loraplex.platform.request_log import BodyLimitMiddleware, RequestLogMiddleware
from loraplex.platform.tenancy import Platform, install_tenancy

logger = logging.getLogger(__name__)


class ServerSettings(BaseSettings):
    """The HTTP server's settings; environment variables ``LORAPLEX_<NAME>`` override them."""

    model_config = SettingsConfigDict(env_prefix="LORAPLEX_", extra="ignore", frozen=True)

    served_model_name: str | None = Field(
        None, min_length=1, description="the base model's name in the API (default: its dir name)"
    )
    api_key: SecretStr | None = Field(
        None, description="operator key for 'Authorization: Bearer'; None = open server"
    )
    metrics_token: SecretStr | None = Field(
        None, description="token that may read /metrics (besides admin callers)"
    )
    max_request_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        le=1024**3,
        description="largest request body accepted (bytes); larger ones get 413 unread. The "
        "default holds the largest useful request at an 8k context (64 prompts of 8,192 token "
        "ids); raise it for longer contexts",
    )
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="max_tokens of a chat request that sets neither max_tokens nor "
        "max_completion_tokens (cut to the room the prompt leaves); None: up to the context. "
        "/v1/completions always defaults to 16, as OpenAI does",
    )
    max_n: int = Field(16, ge=1, le=256)
    max_prompts: int = Field(64, ge=1, le=4096)

    @field_validator("metrics_token")
    @classmethod
    def _non_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value():
            raise ValueError("metrics_token must not be empty; leave it unset for none")
        return value


def mount_routes(app: FastAPI, platform: Platform | None) -> None:
    """Every route of the app, each router with its audience (see ``access``): the one place
    that says which kind of caller reaches what. The operator's LoRA load/unload endpoints exist
    only without the platform, where the operator's ``--api-key`` is the only credential; on the
    platform adapters come through the registry."""
    table: list[tuple[APIRouter, Audience]] = [
        (openai_routes.public_router, "public"),
        (openai_routes.inference_router, "inference"),
        (metrics_router, "metrics"),
    ]
    if platform is None:
        table.append((openai_routes.operator_lora_router, "operator"))
    else:
        from loraplex.platform import admin_api, usage
        from loraplex.platform.registry import routes as registry_routes
        from loraplex.webui import ROUTERS, SESSION_GUARDS

        table += [
            (registry_routes.tenant_router, "tenant"),
            (usage.router, "tenant"),
            (registry_routes.operator_router, "operator"),
            (admin_api.router, "operator"),
            *ROUTERS,
        ]
    for router, audience in table:
        access.mount(app, router, audience, session_guards=SESSION_GUARDS if platform else ())


def load_settings(**overrides: Any) -> ServerSettings:
    """Settings from the environment, then ``overrides`` (CLI flags; None values are skipped)."""
    return ServerSettings(**{k: v for k, v in overrides.items() if v is not None})


def create_app(
    client: EngineClient,
    settings: ServerSettings | None = None,
    *,
    own_client: bool = False,
    tokenizer: Any | None = None,
    authenticator: Authenticator | None = None,
    platform: Platform | None = None,
) -> FastAPI:
    """The app serving ``client``: the single-operator server, or with ``platform`` the
    multi-tenant platform (tenants, keys, registry, quotas, usage, admin API and UI).

    ``own_client``: the app's lifespan starts the client and shuts it down (for ``uvicorn.run``);
    otherwise the caller starts it before serving. ``tokenizer``: the base model's tokenizer
    (default: loaded from ``client.info.model_dir`` on first use). ``authenticator``: who may
    call (default: the operator key of ``settings``).
    """
    settings = settings or load_settings()
    key = settings.api_key.get_secret_value() if settings.api_key is not None else None
    resolver = ModelResolver(settings.served_model_name or "")
    serving = OpenAIServing(
        client,
        resolver,
        ServingConfig(
            max_n=settings.max_n,
            max_prompts=settings.max_prompts,
            default_max_tokens=settings.default_max_tokens,
        ),
        tokenizer,
    )

    def name_base_model() -> None:
        if not resolver.base_name:
            resolver.base_name = Path(client.info.model_dir).name or "model"

    if getattr(client, "info", None) is not None:
        name_base_model()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if own_client:
            await client.start()
        name_base_model()
        try:  # before the first request: loading it (transformers, torch) holds the GIL for s
            await serving.tokenizer()
        except Exception as exc:  # the first request that needs it reports the problem
            logger.warning("the base model's tokenizer could not be loaded yet: %s", exc)
        try:
            yield
        finally:
            if own_client:
                await client.shutdown()

    app = FastAPI(
        title="loraplex",
        summary="OpenAI-compatible multi-LoRA inference",
        lifespan=lifespan,
        docs_url=None,  # Swagger UI loads from a CDN; the platform serves no third-party assets
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.serving = serving
    app.state.authenticator = authenticator or OperatorKeyAuthenticator(key)
    app.state.metrics = metrics = PlatformMetrics(client)
    install_error_handlers(app)
    document_error_envelope(app)
    # Outermost last: the request log wraps the body limit, so a 413 is logged (and counted) too.
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=settings.max_request_bytes, exempt=streams_own_body
    )
    # Components installed later (usage, the admin UI's charts) append to this list; the
    # middleware reads it when Starlette builds the stack, at the first request.
    app.state.request_observers = observers = [metrics.observe]
    app.add_middleware(RequestLogMiddleware, observers=observers)
    if platform is not None:
        install_tenancy(app, platform)
    mount_routes(app, platform)
    return app
