"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes; ``openai.tokenize`` does the
work), for the inference audience: the ``model`` resolves within the caller's tenant."""

from __future__ import annotations

from fastapi import APIRouter, Request

from loraplex.platform.access import InferenceCaller
from loraplex.platform.deps import ServingDep
from loraplex.platform.openai import tokenize as tok
from loraplex.platform.request_log import request_record

router = APIRouter()


def _record(request: Request, caller: InferenceCaller, model: str | None) -> None:
    record = request_record(request)
    record.caller, record.model = caller.id, model
    record.tenant_id, record.key_id = caller.tenant_id, caller.key_id


@router.post("/tokenize", response_model=tok.TokenizeResponse)
async def tokenize(
    body: tok.TokenizeRequest, request: Request, serving: ServingDep, caller: InferenceCaller
) -> tok.TokenizeResponse:
    _record(request, caller, body.model)
    return await tok.tokenize(serving, body, caller)


@router.post("/detokenize", response_model=tok.DetokenizeResponse)
async def detokenize(
    body: tok.DetokenizeRequest, request: Request, serving: ServingDep, caller: InferenceCaller
) -> tok.DetokenizeResponse:
    _record(request, caller, body.model)
    return await tok.detokenize(serving, body, caller)
