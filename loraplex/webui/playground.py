"""The Playground: one prompt, answered by the base model and by a tenant's adapter, side by side.

Routes::

    GET  /admin/playground          ?tenant=<name>: the form, with that tenant's adapters
    POST /admin/playground          (form) both answers, computed whole: the page without scripts
    POST /admin/playground/stream   (form + side=base|adapter) one answer as server-sent events

With scripts, ``static/playground.js`` turns the form's submit into two POSTs to ``stream`` (one
per side, each carrying the form's CSRF token, so both are ``FormPost`` routes) and appends the
text as it arrives. Events::

    event: start   data: {"model": "support-bot@3", "max_tokens": 128}
    data: {"text": "..."}                  (repeated)
    event: done    data: {"finish_reason": "stop", "completion_tokens": 42, "seconds": 0.8}
    event: error   data: {"message": "..."}        (instead of done)

Requests run through the serving layer (``OpenAIServing.open_console_run``: the model resolver,
with the registry for a tenant's adapters; the chat template and tokenizing off the event loop;
``Generation``; the same accounting as API requests) as the operator acting for the tenant: a
``Caller`` with the tenant's id and prefix-cache salt, id ``admin-playground:<tenant>``, scope
``inference`` only. They skip the tenant's quotas, and their usage is recorded as the operator's
(no tenant, model ``playground:<tenant>/<model>``): a tenant is never billed for the console's
experiments. ``max_tokens`` is at most ``MAX_TOKENS``; greedy by default, so the two answers differ
only by the adapter.

The form's optional "JSON schema" box constrains both sides to JSON matching that schema (the
same structured-output path as the API's ``response_format`` json_schema). A schema that is not
JSON, too large, or one the grammar backend cannot enforce is an inline error on the field
(without scripts, the page comes back with it; with scripts, a 400 whose ``param`` is
``schema``), and nothing runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session
from starlette.responses import Response

from loraplex.engine.client import EngineDeadError
from loraplex.grammar import MAX_SCHEMA_CHARS
from loraplex.platform import tenants as tenant_service
from loraplex.platform.auth import SCOPE_INFERENCE, Caller
from loraplex.platform.errors import APIError, engine_unavailable, invalid_request
from loraplex.platform.openai.generation import Generation
from loraplex.platform.openai.serving import OpenAIServing, account
from loraplex.platform.openai.sse import SSEResponse
from loraplex.platform.request_log import CLIENT_CLOSED, RequestRecord
from loraplex.webui.context import (
    Admin,
    FormPost,
    NavItem,
    SignedIn,
    render,
    secure_headers,
    webui_of,
)
from loraplex.webui.tenant_picker import tenant_picker
from loraplex.webui.views import FormErrors, whole_number

logger = logging.getLogger(__name__)

NAV = NavItem("Playground", "/admin/playground")
PATH = "/admin/playground"
STREAM_PATH = "/admin/playground/stream"
USAGE_ENDPOINT = "/admin/playground"  # the usage rows' endpoint
MAX_TOKENS = 256
DEFAULT_MAX_TOKENS = 128
MAX_PROMPT_CHARS = 8000
MAX_TEMPERATURE = 2.0
SEED = 1234  # both sides sample with the same seed when the temperature is above 0

Side = Literal["base", "adapter"]

router = APIRouter(include_in_schema=False)


def _serving(request: Request) -> OpenAIServing:
    return webui_of(request).platform.serving


# ---- the form -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    """A submitted playground form. ``tenant`` "": the operator's own models."""

    tenant: str
    model: str
    prompt: str
    max_tokens: int
    temperature: float
    schema: dict[str, Any] | None = None  # both answers must match it (JSON)

    def sides(self, base_name: str) -> list[tuple[Side, str]]:
        """(side, model) to run: the base model, and the chosen model when it is an adapter."""
        out: list[tuple[Side, str]] = [("base", base_name)]
        if self.model != base_name:
            out.append(("adapter", self.model))
        return out


def form_values(admin: Admin) -> dict[str, str]:
    return {
        "tenant": admin.field("tenant").strip()[:64],
        "model": admin.field("model").strip()[:200],
        "prompt": admin.field("prompt")[: MAX_PROMPT_CHARS + 1],
        "max_tokens": admin.field("max_tokens").strip()[:12],
        "temperature": admin.field("temperature").strip()[:12],
        "schema": admin.field("schema")[: 4 * MAX_SCHEMA_CHARS + 1],
    }


def parse_schema(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """The schema box: (schema, None), (None, None) when blank, (None, what is wrong)."""
    if not text.strip():
        return None, None
    if len(text) > 4 * MAX_SCHEMA_CHARS:
        return None, f"The schema is longer than {4 * MAX_SCHEMA_CHARS:,} characters; shorten it."
    try:
        schema = json.loads(text)
    except RecursionError:
        return None, "The schema nests too deep to read; flatten it."
    except ValueError as exc:
        return None, f"The schema is not valid JSON: {exc}."
    if not isinstance(schema, dict):
        return None, 'The schema must be a JSON object, such as {"type": "object", ...}.'
    return schema, None


def parse_trial(values: dict[str, str], base_name: str) -> tuple[Trial | None, FormErrors]:
    errors = FormErrors()
    prompt = values["prompt"]
    if not prompt.strip():
        errors["prompt"] = "Type a prompt for the models to answer."
    elif len(prompt) > MAX_PROMPT_CHARS:
        errors["prompt"] = f"The prompt is longer than {MAX_PROMPT_CHARS:,} characters; shorten it."
    text = values["max_tokens"] or str(DEFAULT_MAX_TOKENS)
    max_tokens = whole_number(text) or 0
    if not 1 <= max_tokens <= MAX_TOKENS:
        errors["max_tokens"] = f"Max tokens: a whole number from 1 to {MAX_TOKENS}."
    try:
        temperature = float(values["temperature"] or "0")
    except ValueError:
        temperature = -1.0
    if not 0.0 <= temperature <= MAX_TEMPERATURE:  # also refuses nan
        errors["temperature"] = f"Temperature: a number from 0 (greedy) to {MAX_TEMPERATURE:g}."
    schema, schema_error = parse_schema(values.get("schema", ""))
    if schema_error:
        errors["schema"] = schema_error
    if errors:
        return None, errors
    model = values["model"] or base_name
    return Trial(values["tenant"], model, prompt, max_tokens, temperature, schema), errors


async def caller_for(request: Request, tenant: str) -> Caller:
    """The operator acting for ``tenant`` (its adapters, its prefix-cache salt), or for itself
    (``tenant`` ""). 404 (param ``tenant``) for a tenant that does not exist."""
    if not tenant:
        return Caller(id="admin-playground", scopes=frozenset({SCOPE_INFERENCE}))

    def read(session: Session) -> tuple[int, str, str] | None:
        row = tenant_service.get_tenant(session, tenant)
        return None if row is None else (row.id, row.name, row.cache_salt)

    found = await webui_of(request).store.db.run(read)
    if found is None:
        raise APIError(404, f"There is no tenant named {tenant[:64]!r}.", param="tenant")
    tenant_id, name, salt = found
    return Caller(
        id=f"admin-playground:{name}",
        scopes=frozenset({SCOPE_INFERENCE}),
        tenant_id=str(tenant_id),
        cache_salt=salt,
    )


async def model_choices(request: Request, caller: Caller) -> list[tuple[str, str]]:
    """(value, label) of the models ``caller`` may use: its adapters, then the base model."""
    serving = _serving(request)
    base = serving.resolver.base_name
    options = []
    for entry in await serving.resolver.models(caller):
        if entry.name == base:
            continue
        label = entry.name if "@" in entry.name else f"{entry.name} (newest ready version)"
        options.append((entry.name, label))
    options.append((base, f"Base model only ({base})"))
    return options


# ---- one side --------------------------------------------------------------------------------


@dataclass
class Run:
    """One side's generation, opened (the engine request starts at its first event)."""

    side: Side
    model: str  # the resolved name ("support-bot@3", or the base model's)
    generation: Generation
    max_tokens: int
    record: RequestRecord
    started: float = field(default_factory=time.perf_counter)


async def open_run(
    request: Request, caller: Caller, trial: Trial, side: Side, model_name: str
) -> Run:
    """Open one side through the serving layer (the API's resolve, checks and tokenizing, off
    the event loop); raises ``APIError`` (4xx/5xx) when it cannot run."""
    serving = _serving(request)
    rid = f"playground-{uuid.uuid4().hex}"
    try:
        opened = await serving.open_console_run(
            caller,
            model_name,
            trial.prompt,
            max_tokens=trial.max_tokens,
            temperature=trial.temperature,
            seed=SEED if trial.temperature > 0 else None,
            request_id=rid,
            schema=trial.schema,
        )
    except APIError as exc:
        if exc.code == "context_length_exceeded" and "shorten the prompt" not in exc.message:
            raise invalid_request(
                f"The prompt does not fit the model's context "
                f"({serving.client.info.max_model_len:,} tokens); shorten the prompt.",
                "prompt",
                "context_length_exceeded",
            ) from None
        raise
    except EngineDeadError:
        raise engine_unavailable() from None
    except (OSError, ValueError) as exc:  # the tokenizer could not be loaded
        logger.exception("playground: the tokenizer could not be loaded")
        raise APIError(
            503,
            f"The base model's tokenizer could not be loaded ({type(exc).__name__}); see the "
            "server log.",
            code="tokenizer_unavailable",
        ) from None
    who = trial.tenant or "operator"
    record = RequestRecord("POST", USAGE_ENDPOINT)
    record.request_id, record.caller, record.model = rid, caller.id, model_name
    record.served_model = f"playground:{who}/{opened.model.served_name}"
    record.tenant_id = None  # the operator's usage: never billed to the tenant
    return Run(side, opened.model.served_name, opened.generation, opened.max_tokens, record)


def finish_run(request: Request, run: Run, status: int) -> None:
    """Record the run's usage as the operator's (every figure the API's requests record)."""
    run.record.status = status
    account(run.record, run.generation)
    webui_of(request).tenancy.usage.record_request(run.record)


@dataclass
class Answer:
    side: Side
    title: str
    model: str
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    seconds: float = 0.0
    error: str | None = None

    @property
    def meta(self) -> str:
        if self.error:
            return ""
        tokens = f"{self.completion_tokens} token{'s' if self.completion_tokens != 1 else ''}"
        return f"{tokens} · {self.seconds:.2f} s · {describe_finish(self.finish_reason)}"


def describe_finish(reason: str | None) -> str:
    return {
        "stop": "finished",
        "length": "stopped at max tokens",
        "abort": "aborted",
    }.get(reason or "", reason or "unfinished")


def side_title(side: Side) -> str:
    return "Base model" if side == "base" else "Adapter"


async def answer(request: Request, caller: Caller, trial: Trial, side: Side, name: str) -> Answer:
    """One side, run to the end (the page without scripts)."""
    out = Answer(side, side_title(side), name)
    try:
        run = await open_run(request, caller, trial, side, name)
    except APIError as exc:
        out.error = exc.message
        return out
    out.model = run.model
    status = 200
    try:
        async with contextlib.aclosing(run.generation.events()) as events:
            async for ev in events:
                out.text += ev.text if out.text else ev.text.lstrip()
                out.finish_reason = ev.finish_reason or out.finish_reason
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    except Exception as exc:
        status = 503 if isinstance(exc, EngineDeadError) else 500
        out.error = _failure(exc)
    finally:
        out.completion_tokens = run.generation.usage.completion_tokens
        out.seconds = time.perf_counter() - run.started
        finish_run(request, run, status)
    return out


def _failure(exc: Exception) -> str:
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc) or "it stopped").message
    if isinstance(exc, APIError):
        return exc.message
    logger.exception("playground: generation failed", exc_info=exc)
    return f"The generation failed ({type(exc).__name__}); see the server log."


# ---- pages -----------------------------------------------------------------------------------


async def _page(
    request: Request,
    admin: Admin,
    values: dict[str, str],
    *,
    errors: FormErrors | None = None,
    answers: list[Answer] | None = None,
    status: int = 200,
) -> Response:
    errors = errors or FormErrors()
    serving = _serving(request)
    base = serving.resolver.base_name
    models: list[tuple[str, str]] = []
    try:
        caller = await caller_for(request, values["tenant"])
        models = await model_choices(request, caller)
    except APIError as exc:
        errors.setdefault("tenant", exc.message)
        status = max(status, exc.status)
    if not values["model"] and models:
        values = {**values, "model": models[0][0]}
    may_act = not admin.session.read_only  # a viewer runs nothing, so acts for no tenant
    tenants = await webui_of(request).store.db.run(partial(tenant_picker, may_act=may_act))
    return render(
        request,
        "playground.html",
        admin=admin,
        status=status,
        title="Playground",
        values=values,
        errors=errors,
        models=models,
        base_model=base,
        tenants=tenants,
        answers=answers or [],
        max_tokens_limit=MAX_TOKENS,
        max_temperature=f"{MAX_TEMPERATURE:g}",
        stream_path=STREAM_PATH,
    )


@router.get(PATH)
async def playground(request: Request, admin: SignedIn) -> Response:
    values = {
        "tenant": request.query_params.get("tenant", "").strip()[:64],
        "model": request.query_params.get("model", "").strip()[:200],
        "prompt": "",
        "max_tokens": str(DEFAULT_MAX_TOKENS),
        "temperature": "0",
        "schema": "",
    }
    return await _page(request, admin, values)


@router.post(PATH)
async def run_both(request: Request, admin: FormPost) -> Response:
    """Both answers, computed whole and shown on the page (the form without scripts)."""
    values = form_values(admin)
    base = _serving(request).resolver.base_name
    trial, errors = parse_trial(values, base)
    if trial is None:
        return await _page(request, admin, values, errors=errors, status=400)
    try:
        caller = await caller_for(request, trial.tenant)
    except APIError as exc:
        errors["tenant"] = exc.message
        return await _page(request, admin, values, errors=errors, status=exc.status)
    try:
        await _serving(request).check_console_schema(trial.schema)
    except APIError as exc:  # too large, or the backend cannot enforce it: before any run
        errors["schema"] = exc.message
        return await _page(request, admin, values, errors=errors, status=exc.status)
    answers = await asyncio.gather(
        *(answer(request, caller, trial, side, name) for side, name in trial.sides(base))
    )
    return await _page(request, admin, values, answers=list(answers))


def _event(name: str | None, data: dict[str, Any]) -> str:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(request: Request, run: Run) -> AsyncIterator[str]:
    yield _event("start", {"model": run.model, "side": run.side, "max_tokens": run.max_tokens})
    status = 200
    finish: str | None = None
    shown = False  # leading whitespace (a tokenizer's word-start space) is not shown
    try:
        async with contextlib.aclosing(run.generation.events()) as events:
            async for ev in events:
                finish = ev.finish_reason or finish
                text = ev.text if shown else ev.text.lstrip()
                if text:
                    shown = True
                    yield _event(None, {"text": text})
        yield _event(
            "done",
            {
                "finish_reason": finish,
                "finish": describe_finish(finish),
                "completion_tokens": run.generation.usage.completion_tokens,
                "seconds": round(time.perf_counter() - run.started, 3),
            },
        )
    except (asyncio.CancelledError, GeneratorExit):  # the browser went away (or pressed Stop)
        status = CLIENT_CLOSED
        raise
    except Exception as exc:
        status = 503 if isinstance(exc, EngineDeadError) else 500
        yield _event("error", {"message": _failure(exc)})
    finally:
        finish_run(request, run, status)


@router.post(STREAM_PATH)
async def stream(request: Request, admin: FormPost) -> Response:
    """One side as server-sent events; problems before the first event are JSON errors."""
    values = form_values(admin)
    base = _serving(request).resolver.base_name
    trial, errors = parse_trial(values, base)
    if trial is None:
        name, message = next(iter(errors.items()))
        raise APIError(400, message, param=name, code="invalid_playground_form")
    side = admin.field("side")
    chosen = next(((s, m) for s, m in trial.sides(base) if s == side), None)
    if chosen is None:
        raise APIError(
            400,
            "side must be 'base', or 'adapter' when an adapter is chosen as the model.",
            param="side",
        )
    caller = await caller_for(request, trial.tenant)
    await _serving(request).check_console_schema(trial.schema)  # a 400 with param "schema"
    run = await open_run(request, caller, trial, *chosen)
    # SSEResponse: a browser that goes away (or presses Stop) aborts the run at once.
    response = SSEResponse(_stream(request, run), headers={"Cache-Control": "no-store"})
    return secure_headers(response)
