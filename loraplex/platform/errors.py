"""OpenAI's error envelope, ``{"error": {"message", "type", "param", "code"}}``, for every error.

Handlers raise :class:`APIError`; :func:`install_error_handlers` turns it, FastAPI's validation
errors, Starlette's HTTP errors, ``EngineDeadError`` and anything unexpected into that envelope.
Messages never echo raw request values at length (they may be huge or not JSON-serializable).
Only a bug gives a 500; bad input is always a 4xx that says what to change.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.engine.client import EngineDeadError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error answered in OpenAI's envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str) -> APIError:
    return APIError(
        404,
        f"The model {clip(name)} does not exist or you do not have access to it; "
        "GET /v1/models lists the models you can use.",
        param="model",
        code="model_not_found",
    )


def rate_limited(message: str, retry_after_s: int, kind: str = "requests") -> APIError:
    """429 for quotas (``kind``: ``requests`` or ``tokens``, as OpenAI names its limits)."""
    return APIError(
        429,
        message,
        type=kind,
        code="rate_limit_exceeded",
        headers={"Retry-After": str(max(1, retry_after_s))},
    )


def engine_unavailable(detail: str = "") -> APIError:
    why = f" ({detail})" if detail else ""
    return APIError(
        503,
        f"The inference engine is not available{why}; retry in a few seconds, and tell the "
        "operator if it persists.",
        type=SERVER_ERROR,
        code="engine_unavailable",
        headers={"Retry-After": "5"},
    )


def clip(value: object, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: request values go into messages bounded."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shorten(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters (for a request's own text in a message)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def loc_to_param(loc: Sequence[int | str]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``; ``None`` for the body."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    param = ""
    for p in parts:
        if isinstance(p, int):
            param += f"[{p}]"
        elif not _is_type_tag(p):
            param += f".{p}" if param else p
    return param or None


def _is_type_tag(part: str) -> bool:
    # pydantic names union members in locations ("str", "list[int]", "function-after[...]").
    return part in {"str", "int", "list[str]", "list[int]", "list[list[int]]"} or "[" in part


# What a field of several accepted shapes (a union) takes, for messages about it.
UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts ({'type': 'text', 'text': ...})",
}


def _pick(errors: Sequence[Any]) -> tuple[Any, int, bool]:
    """The error to report: for a union field pydantic reports one error per member; the most
    specific (deepest) value error wins, else the union's own hint is used. Returns (error,
    number of other problems, is_union_type_error)."""
    field = tuple(errors[0].get("loc", ()))[:2]
    same = [e for e in errors if tuple(e.get("loc", ()))[:2] == field]
    others = len(errors) - len(same)
    if len(same) == 1:
        return same[0], others, False
    values = [e for e in same if not str(e.get("type", "")).endswith("_type")]
    deepest = max(values or same, key=lambda e: len(e.get("loc", ())))
    return deepest, others, not values


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One message for pydantic's errors: the first error, naming its field, plus a count."""
    err, more, union_type = _pick(errors)
    loc = tuple(err.get("loc", ()))
    param = loc_to_param(loc)
    kind = err.get("type", "")
    if kind == "json_invalid":
        pos = loc[-1] if loc and isinstance(loc[-1], int) else None
        where = f" at byte {pos}" if pos is not None else ""
        why = (err.get("ctx") or {}).get("error", "")
        return (
            f"The request body is not valid JSON{where}: {why}. Send a JSON object with "
            "'Content-Type: application/json'.",
            None,
        )
    if kind == "unknown_fields":  # api.bodies.StrictBody: names every unknown field
        ctx = err.get("ctx") or {}
        field = str(ctx.get("field", ""))
        where = f"'{param}'" if param else "the request body"
        text = str(ctx.get("message", err.get("msg", ""))).replace("<where>", where)
        return text, f"{param}.{field}" if param else field
    if param is None:
        if kind == "missing":
            return "The request has no body; send a JSON object with the request fields.", None
        if isinstance(err.get("input"), bytes | bytearray):
            # FastAPI parses JSON only under a JSON Content-Type (curl -d sends a form's).
            return (
                "The request body was not read as JSON because the request's Content-Type is "
                "missing or not JSON; send it with 'Content-Type: application/json'.",
                None,
            )
        return (
            "The request body must be a JSON object (with 'Content-Type: application/json'); "
            f"{_lower_first(str(err.get('msg', 'it is not')))}.",
            None,
        )
    msg = str(err.get("msg", "is invalid")).removeprefix("Value error, ")
    field_names = [p for p in loc if isinstance(p, str) and not _is_type_tag(p)]
    hint = UNION_HINTS.get(field_names[-1]) if field_names else None
    if kind == "missing":
        text = f"'{param}' is a required property."
    elif kind == "extra_forbidden":
        text = f"'{param}' is not a known property; remove it."
    elif union_type and hint:
        tag = next((i for i, p in enumerate(loc) if isinstance(p, str) and _is_type_tag(p)), None)
        param = loc_to_param(loc[:tag]) or param
        text = f"Invalid value for '{param}': it must be {hint}."
    else:
        text = f"Invalid value for '{param}': {_lower_first(msg)}."
    if more:
        text += f" ({more} more problem{'s' if more > 1 else ''} in the request.)"
    return text, param


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return _answer(request, exc)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = validation_message(exc.errors())
        return _answer(request, invalid_request(message, param, code="invalid_value"))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return _answer(request, _http_error(exc, request))

    async def on_engine_dead(request: Request, exc: Exception) -> JSONResponse:
        return _answer(request, engine_unavailable(str(exc) or "it stopped"))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(
            500,
            "The server failed while handling this request (a bug, not your input); the "
            "operator can find the traceback in the server log.",
            type=SERVER_ERROR,
            code="internal_error",
        ).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(EngineDeadError, on_engine_dead)
    app.add_exception_handler(Exception, on_unexpected)


def _answer(request: Request, error: APIError) -> JSONResponse:
    record = getattr(request.state, "record", None)
    if record is not None:  # the request log's record (loraplex.platform.request_log)
        record.error_code = error.code or error.type
    return error.response()


def _http_error(exc: StarletteHTTPException, request: Request) -> APIError:
    status = exc.status_code
    headers = dict(exc.headers) if exc.headers else None
    if status == 404 and exc.detail == "Not Found":  # the router's: no route has this path
        return APIError(
            404,
            f"There is no endpoint {request.method} {shorten(request.url.path)}. The "
            f"OpenAI-compatible endpoints are: {', '.join(_api_endpoints(request))}; "
            "/openapi.json describes every endpoint.",
            type=NOT_FOUND,
            code="not_found",
        )
    if status == 404:
        return APIError(404, str(exc.detail), type=NOT_FOUND, code="not_found")
    if status == 405:
        return APIError(
            405,
            f"This endpoint does not accept this HTTP method ({exc.detail}); /openapi.json "
            "lists the methods of each endpoint.",
            code="method_not_allowed",
            headers=headers,
        )
    if status == 400:
        # FastAPI's answer to a body json.loads fails on other than by a syntax error.
        return invalid_request(
            f"The request body could not be parsed: {_body_problem(exc.__cause__)}.",
            code="invalid_body",
        )
    return APIError(status, str(exc.detail), code=f"http_{status}", headers=headers)


def _api_endpoints(request: Request) -> list[str]:
    """``METHOD /v1/...`` of every OpenAI-compatible endpoint, as the app's OpenAPI schema
    documents them (so the list is never out of date)."""
    paths: dict[str, dict[str, Any]] = request.app.openapi().get("paths", {})
    return [
        f"{method.upper()} {path}"
        for path, operations in paths.items()
        if path.startswith("/v1/")
        for method in operations
    ]


def _body_problem(cause: BaseException | None) -> str:
    """What was wrong with a body FastAPI could not decode (``cause``: what json.loads raised)."""
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"byte {cause.start} is not valid UTF-8; send the JSON encoded as UTF-8 with "
            "'Content-Type: application/json'"
        )
    if isinstance(cause, RecursionError):
        return "it nests arrays or objects too deeply; send a flatter JSON document"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        # int() refuses over sys.get_int_max_str_digits() digits (4300 by default)
        return "a number in it has thousands of digits; no field takes a number that long"
    return "send UTF-8 encoded JSON with 'Content-Type: application/json'"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body (``APIError.body``): the OpenAPI schema documents it."""

    error: ErrorInfo


def document_error_envelope(app: FastAPI) -> None:
    """Make the OpenAPI schema say what the server does: every 4xx/5xx is OpenAI's envelope
    (``ErrorResponse``), and a body that fails validation is a 400, never FastAPI's 422."""
    from fastapi.openapi.utils import get_openapi

    statuses = {
        "400": "Invalid request (the message names the field)",
        "401": "Missing or invalid API key",
        "403": "The key lacks the needed scope, or the tenant is suspended",
        "404": "Unknown model, adapter, tenant or key",
        "413": "Request body too large",
        "429": "Rate limit exceeded (see Retry-After)",
        "503": "The engine is unavailable (restarting); retry later",
    }

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            ref = {"$ref": "#/components/schemas/ErrorResponse"}
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components["ErrorResponse"] = ErrorResponse.model_json_schema(
                ref_template="#/components/schemas/{model}"
            )
            components.update(components["ErrorResponse"].pop("$defs", {}))
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    responses = operation.setdefault("responses", {})
                    responses.pop("422", None)
                    for status, text in statuses.items():
                        responses.setdefault(
                            status,
                            {"description": text, "content": {"application/json": {"schema": ref}}},
                        )
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
