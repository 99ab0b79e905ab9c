"""Typed FastAPI dependencies: how a route reaches the platform's components.

The application (built by ``loraplex.server``) holds one ``Platform``; a route asks for the part
it uses (``serving: ServingDep``, ``registry: RegistryDep``, ...), never for the application's
state. The multi-tenant parts exist only on the platform; their routes are mounted only there
(``app.mount_routes``), so ``TenancyDep`` not finding them is a bug, answered 500.
"""

from __future__ import annotations

from typing import Annotated, Protocol, cast

from fastapi import Depends, Request

from loraplex.engine.client import EngineClient
from loraplex.platform.components import Platform, Tenancy
from loraplex.platform.errors import SERVER_ERROR, APIError
from loraplex.platform.metrics import PlatformMetrics
from loraplex.platform.openai.serving import OpenAIServing
from loraplex.platform.quotas import QuotaManager
from loraplex.platform.registry.service import Registry
from loraplex.platform.settings import ServerSettings
from loraplex.platform.store import Store
from loraplex.platform.tenants import TenantService
from loraplex.platform.usage import UsageRecorder


class HasPlatform(Protocol):
    """The application: ``loraplex.server.LoraplexApp``."""

    platform: Platform


def get_platform(request: Request) -> Platform:
    return cast(HasPlatform, request.app).platform


PlatformDep = Annotated[Platform, Depends(get_platform)]


def get_tenancy(platform: PlatformDep) -> Tenancy:
    if platform.tenancy is None:
        raise APIError(
            500,
            "This route belongs to the multi-tenant platform, which this server does not run.",
            type=SERVER_ERROR,
            code="no_platform",
        )
    return platform.tenancy


TenancyDep = Annotated[Tenancy, Depends(get_tenancy)]


def _settings(platform: PlatformDep) -> ServerSettings:
    return platform.settings


def _client(platform: PlatformDep) -> EngineClient:
    return platform.client


def _serving(platform: PlatformDep) -> OpenAIServing:
    return platform.serving


def _metrics(platform: PlatformDep) -> PlatformMetrics:
    return platform.metrics


def _store(tenancy: TenancyDep) -> Store:
    return tenancy.store


def _registry(tenancy: TenancyDep) -> Registry:
    return tenancy.registry


def _quotas(tenancy: TenancyDep) -> QuotaManager:
    return tenancy.quotas


def _usage(tenancy: TenancyDep) -> UsageRecorder:
    return tenancy.usage


def _tenants(tenancy: TenancyDep) -> TenantService:
    return tenancy.tenants


SettingsDep = Annotated[ServerSettings, Depends(_settings)]
ClientDep = Annotated[EngineClient, Depends(_client)]
ServingDep = Annotated[OpenAIServing, Depends(_serving)]
MetricsDep = Annotated[PlatformMetrics, Depends(_metrics)]
StoreDep = Annotated[Store, Depends(_store)]
RegistryDep = Annotated[Registry, Depends(_registry)]
QuotasDep = Annotated[QuotaManager, Depends(_quotas)]
UsageDep = Annotated[UsageRecorder, Depends(_usage)]
TenantsDep = Annotated[TenantService, Depends(_tenants)]
