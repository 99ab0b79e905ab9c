"""The registry's HTTP API: a tenant's own adapters under ``/v1/adapters``, and any tenant's
under ``/admin/api/tenants/{tenant}/adapters`` for the operator.

Reads take any valid tenant key; uploads and deletes need the ``adapters:write`` scope. The
tenant is always the key's: fields such as ``tenant`` or ``owner`` in a tenant's upload are
ignored. The operator's upload, like every admin body, refuses text fields it does not know
(400 naming them) rather than drop them.
Responses never hold storage paths. A key limited to a list of models (``model_access``) sees
and deletes only the adapters and versions its list allows (others answer 404 exactly like a
missing adapter) and uploads only names on its list (403). The operator may also retry a version whose engine load
failed (``POST .../adapters/{name}/versions/{number}/retry``): its next request loads it again.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel

from loraplex.platform import tenants
from loraplex.platform.access import OperatorCaller, TenantCaller, TenantWriter
from loraplex.platform.auth import Caller
from loraplex.platform.db.scope import TenantScope
from loraplex.platform.deps import RegistryDep
from loraplex.platform.errors import PERMISSION, APIError, clip
from loraplex.platform.model_access import allows
from loraplex.platform.registry.records import AdapterView, VersionView, adapter_not_found
from loraplex.platform.registry.resolver import model_name
from loraplex.platform.registry.service import Registry, parse_tenant_id
from loraplex.platform.registry.upload import check_content_length, receive_upload

tenant_router = APIRouter()  # a tenant's own adapters (audience "tenant")
operator_router = APIRouter()  # any tenant's, for the operator (audience "operator")


class AdapterVersionCard(BaseModel):
    object: Literal["adapter.version"] = "adapter.version"
    id: str  # "name@N": this version in the adapter routes' paths
    model: str  # what the ``model`` field takes to use exactly this version (gateway mode:
    # "tenant/name@N", also in /v1/models and the metrics; else as ``id``)
    number: int
    status: str  # validating | ready
    rank: int
    alpha: float
    target_modules: list[str]
    size_bytes: int
    content_sha256: str  # the engine's key; equal for equal adapters
    created: int


class AdapterCard(BaseModel):
    object: Literal["adapter"] = "adapter"
    id: str  # the name, in the adapter routes' paths
    model: str  # the ``model`` field's value for the newest ready version ("tenant/name" in
    # gateway mode, also in /v1/models and the metrics; else the name)
    owned_by: str  # the tenant
    parent: str  # the base model
    description: str
    created: int
    latest_version: int | None  # the newest ready version's number
    versions: list[AdapterVersionCard]


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterCard]


class AdapterDeleted(BaseModel):
    id: str
    object: Literal["adapter", "adapter.version"]
    deleted: bool = True


class AdapterVersionRetried(BaseModel):
    id: str  # name@N
    object: Literal["adapter.version"] = "adapter.version"
    had_failed: bool  # the engine held a load failure for it, now forgotten


VersionNumber = Annotated[int, Path(ge=1, le=2**31 - 1)]


def _ts(when: dt.datetime) -> int:
    return int(when.timestamp())


def _version_card(name: str, v: VersionView, model: str) -> AdapterVersionCard:
    return AdapterVersionCard(
        id=f"{name}@{v.number}",
        model=f"{model}@{v.number}",
        number=v.number,
        status=v.status,
        rank=v.rank,
        alpha=v.alpha,
        target_modules=list(v.target_modules),
        size_bytes=v.size_bytes,
        content_sha256=v.content_sha256,
        created=_ts(v.created_at),
    )


def _card(view: AdapterView, base: str, gateway: bool) -> AdapterCard:
    latest = view.latest_ready
    model = model_name(view.tenant, view.name, gateway)
    return AdapterCard(
        id=view.name,
        model=model,
        owned_by=view.tenant,
        parent=base,
        description=view.description,
        created=_ts(view.created_at),
        latest_version=latest.number if latest is not None else None,
        versions=[_version_card(view.name, v, model) for v in view.versions],
    )


def _own_tenant(caller: Caller) -> int:
    tenant_id = parse_tenant_id(caller.tenant_id)
    if tenant_id is None:
        raise APIError(
            403,
            "Adapters belong to tenants: call this with a tenant's API key. The operator "
            "manages a tenant's adapters under /admin/api/tenants/{tenant}/adapters.",
            type=PERMISSION,
            code="tenant_key_required",
        )
    return tenant_id


async def _tenant_named(registry: Registry, name: str) -> int:
    return await registry.db.run(lambda s: tenants.require_tenant(s, name).id)


# The text fields an upload reads (``Registry.upload``); the files are recognised by their names.
UPLOAD_FIELDS = ("name", "description")


def _refuse_unknown_fields(fields: dict[str, str]) -> None:
    unknown = [f for f in fields if f not in UPLOAD_FIELDS]
    if unknown:
        names = ", ".join(clip(f, 40) for f in unknown[:10])
        raise APIError(
            400,
            f"Unknown form field{'s' if len(unknown) > 1 else ''} {names} in the upload; remove "
            f"{'them' if len(unknown) > 1 else 'it'}. An upload takes the text fields "
            f"{', '.join(UPLOAD_FIELDS)} and the adapter's files (adapter_config.json and "
            "*.safetensors, or one .zip / .tar.gz / .tar); the tenant is the one in the path.",
            param=unknown[0][:40],
            code="invalid_value",
        )


def _allows(allowed: tuple[str, ...] | None, tenant: str, ref: str) -> bool:
    """Whether a model list names ``ref`` of ``tenant`` as requests do: ``name[@N]``, or
    ``tenant/name[@N]`` in gateway mode (``registry.resolver.model_name``)."""
    return allows(allowed, ref) or allows(allowed, f"{tenant}/{ref}")


def _visible(view: AdapterView, allowed: tuple[str, ...] | None) -> AdapterView | None:
    """``view`` as a key with the model list ``allowed`` sees it: whole when its name is
    allowed, else only its allowed versions; None when none is."""
    if _allows(allowed, view.tenant, view.name):
        return view
    versions = tuple(
        v for v in view.versions if _allows(allowed, view.tenant, f"{view.name}@{v.number}")
    )
    if not versions:
        return None
    return AdapterView(view.name, view.tenant, view.description, view.created_at, versions)


def _shown(view: AdapterView, caller: Caller, ref: str) -> AdapterView:
    """``view`` as ``caller``'s key sees it; off its model list, the 404 of a missing one."""
    shown = _visible(view, caller.allowed_models)
    if shown is None:
        raise adapter_not_found(ref)
    return shown


def _check_upload_name(caller: Caller, tenant: str, fields: dict[str, str]) -> None:
    name = fields.get("name", "")
    if caller.allowed_models is not None and not _allows(caller.allowed_models, tenant, name):
        raise APIError(
            403,
            f"This API key may use only the models {', '.join(caller.allowed_models)[:200]}, so "
            f"it cannot upload the adapter {clip(name, 70)}; upload it with a key without a "
            "model list, or ask the operator to add the name to this key's list.",
            type=PERMISSION,
            param="name",
            code="model_not_allowed",
        )


async def _upload(
    request: Request,
    registry: Registry,
    tenant_id: int,
    actor: str,
    *,
    strict: bool = False,
    caller: Caller | None = None,
) -> AdapterCard:
    """``strict``: unknown text fields are a 400 (the operator's route); ``caller``: the
    tenant's key, whose model list bounds the names it may upload."""
    limit = registry.settings.max_adapter_bytes
    check_content_length(request.headers, limit)
    with registry.upload_slots.hold():  # 429 when full; given back however the upload ends
        work_dir = registry.storage.new_upload_dir()
        try:
            received = await receive_upload(
                request.stream(), request.headers.get("content-type"), work_dir / "received", limit
            )
            if strict:
                _refuse_unknown_fields(received.fields)
            if caller is not None and caller.allowed_models is not None:
                tenant = await registry.db.run(lambda s: TenantScope(s, tenant_id).tenant().name)
                _check_upload_name(caller, tenant, received.fields)
            view = await registry.upload(tenant_id, actor, received, work_dir)
        finally:
            registry.storage.discard(work_dir)
    return _card(view, registry.base_name(), registry.settings.gateway_mode)


async def _delete(registry: Registry, tenant_id: int, actor: str, ref: str) -> AdapterDeleted:
    deleted = await registry.delete(tenant_id, actor, ref)
    kind: Literal["adapter", "adapter.version"] = (
        "adapter" if deleted.version is None else "adapter.version"
    )
    return AdapterDeleted(id=str(deleted), object=kind)


# ---- a tenant's own adapters -------------------------------------------------------------------


@tenant_router.post("/v1/adapters", response_model=AdapterCard, status_code=201)
async def upload_adapter(
    request: Request, registry: RegistryDep, caller: TenantWriter
) -> AdapterCard:
    """Multipart: ``name``, optional ``description``, and the adapter as
    ``adapter_config.json`` + ``adapter_model.safetensors`` or one .zip / .tar.gz / .tar."""
    tenant_id = _own_tenant(caller)
    return await _upload(request, registry, tenant_id, caller.id, caller=caller)


@tenant_router.get("/v1/adapters", response_model=AdapterList)
async def list_adapters(registry: RegistryDep, caller: TenantCaller) -> AdapterList:
    views = await registry.list_adapters(_own_tenant(caller))
    shown = [v for v in (_visible(view, caller.allowed_models) for view in views) if v is not None]
    return AdapterList(
        data=[_card(v, registry.base_name(), registry.settings.gateway_mode) for v in shown]
    )


@tenant_router.get("/v1/adapters/{ref}", response_model=AdapterCard)
async def get_adapter(ref: str, registry: RegistryDep, caller: TenantCaller) -> AdapterCard:
    """``name`` (every version) or ``name@N`` (that version)."""
    view = _shown(await registry.get_adapter(_own_tenant(caller), ref), caller, ref)
    return _card(view, registry.base_name(), registry.settings.gateway_mode)


@tenant_router.delete("/v1/adapters/{ref}", response_model=AdapterDeleted)
async def delete_adapter(ref: str, registry: RegistryDep, caller: TenantWriter) -> AdapterDeleted:
    """``name`` deletes every version; ``name@N`` one version (the last one: the adapter)."""
    tenant_id = _own_tenant(caller)
    if caller.allowed_models is not None:  # only what the key's list names, whole
        view = await registry.get_adapter(tenant_id, ref)
        if not _allows(caller.allowed_models, view.tenant, ref):
            raise adapter_not_found(ref)
    return await _delete(registry, tenant_id, caller.id, ref)


# ---- the operator, for any tenant --------------------------------------------------------------


@operator_router.post(
    "/admin/api/tenants/{tenant}/adapters", response_model=AdapterCard, status_code=201
)
async def admin_upload_adapter(
    tenant: str, request: Request, registry: RegistryDep, caller: OperatorCaller
) -> AdapterCard:
    """Multipart, as ``POST /v1/adapters`` takes it; unknown text fields are refused."""
    tenant_id = await _tenant_named(registry, tenant)
    return await _upload(request, registry, tenant_id, caller.id, strict=True)


@operator_router.get("/admin/api/tenants/{tenant}/adapters", response_model=AdapterList)
async def admin_list_adapters(
    tenant: str, registry: RegistryDep, caller: OperatorCaller
) -> AdapterList:
    views = await registry.list_adapters(await _tenant_named(registry, tenant))
    return AdapterList(
        data=[_card(v, registry.base_name(), registry.settings.gateway_mode) for v in views]
    )


@operator_router.get("/admin/api/tenants/{tenant}/adapters/{ref}", response_model=AdapterCard)
async def admin_get_adapter(
    tenant: str, ref: str, registry: RegistryDep, caller: OperatorCaller
) -> AdapterCard:
    view = await registry.get_adapter(await _tenant_named(registry, tenant), ref)
    return _card(view, registry.base_name(), registry.settings.gateway_mode)


@operator_router.delete("/admin/api/tenants/{tenant}/adapters/{ref}", response_model=AdapterDeleted)
async def admin_delete_adapter(
    tenant: str, ref: str, registry: RegistryDep, caller: OperatorCaller
) -> AdapterDeleted:
    return await _delete(registry, await _tenant_named(registry, tenant), caller.id, ref)


@operator_router.post(
    "/admin/api/tenants/{tenant}/adapters/{name}/versions/{number}/retry",
    response_model=AdapterVersionRetried,
)
async def admin_retry_version(
    tenant: str, name: str, number: VersionNumber, registry: RegistryDep, caller: OperatorCaller
) -> AdapterVersionRetried:
    """Forget the engine's load failure of ``name@number`` (requests on it got 422
    ``adapter_failed``): its next request loads it again. Audited; ``had_failed`` false when
    there was none (nothing changes)."""
    tenant_id = await _tenant_named(registry, tenant)
    had_failed = await registry.retry(tenant_id, caller.id, name, number)
    return AdapterVersionRetried(id=f"{name}@{number}", had_failed=had_failed)
