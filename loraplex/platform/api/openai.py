"""The OpenAI-compatible endpoints (``inference_router``), health and version
(``public_router``), and vLLM's adapter endpoints for the operator (``operator_lora_router``:
``operator_adapters``); ``access.mount`` gives each its audience."""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from loraplex.engine.client import EngineClient
from loraplex.platform.access import inference_caller, operator_caller
from loraplex.platform.auth import Caller
from loraplex.platform.deps import PlatformDep, ServingDep
from loraplex.platform.engine_state import EngineNotAnswering, read_engine_stats
from loraplex.platform.errors import model_not_found
from loraplex.platform.model_resolver import ModelEntry
from loraplex.platform.openai.protocol import (
    AdapterCard,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    Deleted,
    Health,
    LoadLoRARequest,
    ModelCard,
    ModelList,
    UnloadLoRARequest,
    Version,
)
from loraplex.platform.request_log import request_record

public_router = APIRouter()
inference_router = APIRouter()
operator_lora_router = APIRouter()

inference = Depends(inference_caller)
operator = Depends(operator_caller)

_HEALTH_STATS = (
    "num_running",
    "num_waiting",
    "num_inflight",
    "kv_cache_usage",
    "kv_blocks_used",
    "kv_blocks_total",
    "num_preemptions",
    "engine_restarts",
)


def _card(entry: ModelEntry, max_model_len: int) -> ModelCard:
    return ModelCard(
        id=entry.name,
        created=entry.created,
        owned_by=entry.owned_by,
        parent=entry.parent,
        max_model_len=max_model_len,
    )


@inference_router.get("/v1/models", response_model=ModelList)
async def list_models(serving: ServingDep, caller: Caller = inference) -> ModelList:
    limit = serving.client.info.max_model_len
    return ModelList(data=[_card(e, limit) for e in await serving.resolver.models(caller)])


@inference_router.get("/v1/models/{name:path}", response_model=ModelCard)
async def retrieve_model(name: str, serving: ServingDep, caller: Caller = inference) -> ModelCard:
    for entry in await serving.resolver.models(caller):
        if entry.name == name:
            return _card(entry, serving.client.info.max_model_len)
    raise model_not_found(name)


@inference_router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(
    body: CompletionRequest,
    request: Request,
    response: Response,
    serving: ServingDep,
    caller: Caller = inference,
) -> CompletionResponse | Response:
    result = await serving.completions(body, caller, request)
    response.headers["X-Request-Id"] = request_record(request).request_id or ""
    response.headers.update(getattr(request.state, "rate_limit_headers", {}))
    return result


@inference_router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    response: Response,
    serving: ServingDep,
    caller: Caller = inference,
) -> ChatCompletionResponse | Response:
    result = await serving.chat(body, caller, request)
    response.headers["X-Request-Id"] = request_record(request).request_id or ""
    response.headers.update(getattr(request.state, "rate_limit_headers", {}))
    return result


@operator_lora_router.post("/v1/load_lora_adapter", response_model=AdapterCard)
async def load_lora_adapter(
    body: LoadLoRARequest, request: Request, platform: PlatformDep, caller: Caller = operator
) -> AdapterCard:
    """vLLM's (and AIBrix's) ``{"lora_name", "lora_path"}``: 200 with the adapter's card."""
    request_record(request).caller = caller.id
    info = await platform.operator_adapters.load(
        body.lora_name, body.lora_path, pinned=bool(body.pinned)
    )
    return AdapterCard(
        id=info.name,
        parent=platform.resolver.base_name,
        key=info.key,
        rank=info.rank,
        target_modules=list(info.target_modules),
        size_bytes=info.size_bytes,
    )


@operator_lora_router.post("/v1/unload_lora_adapter", response_model=Deleted)
async def unload_lora_adapter(
    body: UnloadLoRARequest, request: Request, platform: PlatformDep, caller: Caller = operator
) -> Deleted:
    request_record(request).caller = caller.id
    await platform.operator_adapters.unload(body.lora_name)
    return Deleted(id=body.lora_name)


@public_router.get("/health", response_model=Health)
async def health(serving: ServingDep) -> Health | Response:
    """200 while the engine serves, 503 otherwise; no credentials needed (load balancers)."""
    client: EngineClient = serving.client
    engine: dict[str, object] = {"healthy": client.healthy}
    healthy = client.healthy
    if healthy:
        try:
            stats = await read_engine_stats(client)
        except EngineNotAnswering as exc:  # a hung or dead engine is exactly what /health says
            healthy = False
            engine.update(healthy=False, error=exc.reason)
        else:
            engine.update({k: getattr(stats, k) for k in _HEALTH_STATS})
    if not client.healthy:
        engine["reason"] = client.unhealthy_reason
    body = Health(status="ok" if healthy else "unhealthy", engine=engine)
    if healthy:
        return body
    return JSONResponse(body.model_dump(), status_code=503)


@public_router.get("/version", response_model=Version)
async def version() -> Version:
    try:
        return Version(version=metadata.version("loraplex"))
    except metadata.PackageNotFoundError:
        return Version(version="unknown")
