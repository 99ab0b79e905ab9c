"""``python -m benchmarks.structured_suite``: structured output and tool calling, end to end.

Starts ``loraplex serve --demo`` (the embedded SmolLM2 and its demo adapters) in a subprocess,
gives the demo tenant a fresh key through the admin API, and drives the server with the official
``openai`` client, ``concurrency`` requests at a time:

json_schema
    every schema of ``schemas`` (the corpus) through ``response_format`` json_schema (strict),
    half through a demo adapter, a third streamed, a few sampled with a seed;
regex, choice, grammar
    ``structured_outputs`` (or the ``guided_*`` spellings) on chat and completions;
tools
    ``tool_choice`` required and named, streamed and not, one after a ``role: tool`` result;
parse, json_object, refusal
    ``chat.completions.parse`` with a Pydantic model, ``{"type": "json_object"}``, and requests
    that must get a 400 (an invalid schema or regex, two constraints, an unknown tool).

An output is valid when it passes ``check`` and did not stop at ``max_tokens``.
Writes ``structured-suite-<time>.json`` (every case, totals per kind).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.structured_suite.check import (
    Outcome,
    ToolCall,
    ToolCallAssembler,
    check_choice,
    check_finish,
    check_json,
    check_pattern,
    check_refusal,
    check_tool_calls,
    totals,
    totals_table,
)
from benchmarks.structured_suite.constraints import (
    CONSTRAINT_CASES,
    JSON_OBJECT_CASES,
    PARSE_CASES,
    REFUSAL_CASES,
    TOOL_CASES,
    TOOLS,
    ConstraintCase,
    JsonObjectCase,
    ParseCase,
    RefusalCase,
    ToolCase,
)
from benchmarks.structured_suite.options import SuiteOptions
from benchmarks.structured_suite.schemas import SCHEMA_CASES, SchemaCase
from loraplex.bench.common import machine
from loraplex.bench.http_load import Platform, ServerProcess

Log = Callable[[str], None]
Case = SchemaCase | ConstraintCase | ToolCase | ParseCase | JsonObjectCase | RefusalCase
DEMO_TENANT = "demo"  # loraplex.platform.demo.DEMO_TENANT: its adapters are the demo adapters


@dataclass(frozen=True)
class Job:
    """One request of the plan: which case, through an adapter or the base, streamed, sampled."""

    kind: str
    case: Case
    index: int  # within its kind
    adapter: bool
    streamed: bool
    sampled: bool

    @property
    def endpoint(self) -> str:
        return getattr(self.case, "endpoint", "chat")


def plan(kinds: tuple[str, ...], cases: str | None = None) -> list[Job]:
    """The suite's requests, fixed by each case's index in its kind: JSON schemas alternate
    adapter and base, every third is streamed, every seventh (from the fourth) sampled."""
    corpus: dict[str, tuple[Case, ...]] = {
        "json_schema": SCHEMA_CASES,
        "regex": tuple(c for c in CONSTRAINT_CASES if c.kind == "regex"),
        "choice": tuple(c for c in CONSTRAINT_CASES if c.kind == "choice"),
        "grammar": tuple(c for c in CONSTRAINT_CASES if c.kind == "grammar"),
        "tools": TOOL_CASES,
        "parse": PARSE_CASES,
        "json_object": JSON_OBJECT_CASES,
        "refusal": REFUSAL_CASES,
    }
    jobs: list[Job] = []
    for kind in kinds:
        for i, case in enumerate(corpus[kind]):
            if cases and not any(part in case.name for part in cases.split(",")):
                continue
            if kind == "tools":
                adapter, streamed, sampled = i % 3 == 2, i % 2 == 1, i % 4 == 3
            elif kind in ("parse", "json_object", "refusal"):
                adapter, streamed, sampled = i % 2 == 1, False, False
            else:
                adapter, streamed, sampled = i % 2 == 0, i % 3 == 1, i % 7 == 3
            jobs.append(Job(kind, case, i, adapter, streamed, sampled))
    return jobs


# ---- one request -------------------------------------------------------------------------------


@dataclass
class Reply:
    text: str = ""
    calls: list[ToolCall] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    tokens: int | None = None


def _chat(client: Any, request: dict[str, Any], streamed: bool) -> Reply:
    if not streamed:
        r = client.chat.completions.create(**request)
        choice = r.choices[0]
        calls = [
            ToolCall(c.id, c.function.name, c.function.arguments)
            for c in choice.message.tool_calls or ()
        ]
        tokens = r.usage.completion_tokens if r.usage else None
        return Reply(choice.message.content or "", calls, choice.finish_reason, tokens)
    reply, parts, tools = Reply(), [], ToolCallAssembler()
    stream = client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage:
            reply.tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.delta.tool_calls:
                tools.add(d.model_dump() for d in choice.delta.tool_calls)
            reply.finish_reason = choice.finish_reason or reply.finish_reason
    reply.text, reply.calls = "".join(parts), tools.calls()
    return reply


def _completion(client: Any, request: dict[str, Any], streamed: bool) -> Reply:
    if not streamed:
        r = client.completions.create(**request)
        tokens = r.usage.completion_tokens if r.usage else None
        return Reply(r.choices[0].text, [], r.choices[0].finish_reason, tokens)
    reply, parts = Reply(), []
    stream = client.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage:
            reply.tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            parts.append(choice.text or "")
            reply.finish_reason = choice.finish_reason or reply.finish_reason
    reply.text = "".join(parts)
    return reply


def _messages(prompt: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": prompt}]


def _run(client: Any, job: Job, seed: int, request: dict[str, Any]) -> tuple[Reply, str | None]:
    """Send ``job`` (``request`` holds its model; the rest is filled in here, so a failed call
    still shows what was sent); returns the reply and the check's verdict."""
    case = job.case
    request["max_tokens"] = getattr(case, "max_tokens", 16)
    request |= (
        {"temperature": 0.8, "top_p": 0.95, "seed": seed} if job.sampled else {"temperature": 0}
    )
    if isinstance(case, SchemaCase):
        request["messages"] = _messages(case.prompt)
        request["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": case.name, "schema": case.schema, "strict": True},
        }
        reply = _chat(client, request, job.streamed)
        return reply, check_json(reply.text, case.schema)
    if isinstance(case, ConstraintCase):
        request["extra_body"] = case.body()
        if case.endpoint == "completions":
            request["prompt"] = case.prompt
            reply = _completion(client, request, job.streamed)
        else:
            request["messages"] = _messages(case.prompt)
            reply = _chat(client, request, job.streamed)
        if case.kind == "choice":
            return reply, check_choice(reply.text, list(case.value))
        return reply, check_pattern(reply.text, case.full_pattern())
    if isinstance(case, ToolCase):
        request["messages"] = list(case.messages)
        request["tools"] = [TOOLS[name] for name in case.tools]
        request["tool_choice"] = case.tool_choice_param()
        if case.parallel_tool_calls is not None:
            request["parallel_tool_calls"] = case.parallel_tool_calls
        reply = _chat(client, request, job.streamed)
        return reply, check_tool_calls(reply.calls, case)
    if isinstance(case, ParseCase):
        request["messages"] = _messages(case.prompt)
        r = client.chat.completions.parse(**request, response_format=case.model)
        request["response_format"] = case.model.__name__  # for the report
        choice = r.choices[0]
        tokens = r.usage.completion_tokens if r.usage else None
        reply = Reply(choice.message.content or "", [], choice.finish_reason, tokens)
        error = check_json(reply.text, case.model.model_json_schema())
        if error is None and choice.message.parsed is None:
            error = "message.parsed is None"
        return reply, error
    if isinstance(case, JsonObjectCase):
        request["messages"] = _messages(case.prompt)
        request["response_format"] = {"type": "json_object"}
        reply = _chat(client, request, job.streamed)
        return reply, check_json(reply.text, {"type": "object"})
    request["messages"] = _messages("Hello!")
    request |= case.create_args
    return _chat(client, request, False), "answered 200; expected a 400"


def run_job(
    client: Any, job: Job, models: tuple[str, tuple[str, ...]], seed: int, only: str | None = None
) -> Outcome:
    """Send ``job`` and judge its reply; ``only``: the model every job goes to."""
    import openai

    base, adapters = models
    # adapter jobs take the adapters in turn (every other index is an adapter job)
    adapter = adapters[(job.index // 2) % len(adapters)] if job.adapter and adapters else None
    if only is not None:
        adapter = None if only == base else only
    model = adapter or base
    outcome = Outcome(
        job.kind, job.case.name, model, adapter, job.streamed, job.sampled, job.endpoint
    )
    request: dict[str, Any] = {"model": model}
    start = time.monotonic()
    try:
        reply, error = _run(client, job, seed + job.index, request)
        outcome.finish_reason, outcome.tokens = reply.finish_reason, reply.tokens
        outcome.output = (
            reply.text
            if not reply.calls
            else json.dumps([dataclasses.asdict(c) for c in reply.calls])
        )
        outcome.error = check_finish(reply.finish_reason) or error
    except openai.LengthFinishReasonError as exc:  # parse(): the output stopped at max_tokens
        outcome.finish_reason = "length"
        outcome.error = check_finish("length")
        outcome.tokens = exc.completion.usage.completion_tokens if exc.completion.usage else None
        outcome.output = exc.completion.choices[0].message.content or ""
    except openai.APIStatusError as exc:
        message = _error_message(exc)
        if isinstance(job.case, RefusalCase):  # what was asked: a 400 that says what was wrong
            outcome.output = message
            outcome.error = check_refusal(exc.status_code, _error_object(exc), job.case)
        else:
            outcome.error = f"HTTP {exc.status_code}: {message}"
    except Exception as exc:  # a broken reply is this case's failure, not the suite's
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.seconds = round(time.monotonic() - start, 3)
    outcome.valid = outcome.error is None
    outcome.output = outcome.output[:600]
    if not outcome.valid:
        outcome.request = json.loads(json.dumps(request, default=str))
    return outcome


def _error_object(exc: Any) -> Any:
    """The ``error`` object of an error reply (the client hands it over unwrapped, or not)."""
    body = exc.body
    return body.get("error", body) if isinstance(body, dict) else body


def _error_message(exc: Any) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error", body) if isinstance(body, dict) else {}
    return str(error.get("message") if isinstance(error, dict) else exc.message) or str(exc)


# ---- the server and the run ----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    base_url: str  # without /v1
    api_key: str


def served_models(target: Target) -> tuple[str, tuple[str, ...]]:
    """The base model's name and the adapters the key's tenant may use, from ``/v1/models``."""
    r = httpx.get(
        f"{target.base_url}/v1/models",
        headers={"Authorization": f"Bearer {target.api_key}"},
        timeout=30,
    )
    r.raise_for_status()
    return pick_models(r.json()["data"])


def pick_models(data: list[dict[str, Any]]) -> tuple[str, tuple[str, ...]]:
    """From ``/v1/models``' cards: the base (no parent) and the adapters, by their latest names
    where the list also has pinned versions."""
    base = next(m["id"] for m in data if not m.get("parent"))
    adapters = sorted(m["id"] for m in data if m.get("parent"))
    latest = [a for a in adapters if "@" not in a]  # "caps@1" is a pinned version of "caps"
    return base, tuple(latest or adapters)


@contextmanager
def demo_server(opts: SuiteOptions, log: Log) -> Iterator[Target]:
    """A fresh ``loraplex serve --demo``, and a new key of its demo tenant."""
    with tempfile.TemporaryDirectory(prefix="loraplex-structured-") as tmp:
        args = ["--demo", "--log-level", "warning", *opts.serve_args]
        server = ServerProcess(args, Path(tmp), secrets.token_urlsafe(24))
        log("starting loraplex serve --demo ...")
        with server:

            async def key() -> str:
                async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                    return await Platform(http, server.admin_token).key(DEMO_TENANT)

            try:
                yield Target(server.base_url, asyncio.run(key()))
            except Exception as exc:
                raise RuntimeError(f"{exc}\nserver log:\n{server.log_tail()}") from exc


def run_suite(opts: SuiteOptions, log: Log = print) -> dict[str, Any]:
    jobs = plan(opts.kinds, opts.cases)
    if not jobs:
        raise ValueError(f"no case matches --kinds {','.join(opts.kinds)} --cases {opts.cases}")
    start = time.monotonic()
    if opts.base_url and opts.api_key:
        outcomes, models = _drive(Target(opts.base_url.rstrip("/"), opts.api_key), jobs, opts, log)
    else:
        with demo_server(opts, log) as target:
            start = time.monotonic()  # the requests' time, not the server's start
            outcomes, models = _drive(target, jobs, opts, log)
    wall_s = round(time.monotonic() - start, 1)
    summary = totals(outcomes)
    result: dict[str, Any] = {
        "benchmark": "structured-suite",
        "command": opts.command_line(),
        "options": dataclasses.asdict(opts) | {"api_key": None},
        "machine": machine(),
        "models": {"base": models[0], "adapters": list(models[1])},
        "requests_wall_s": wall_s,
        "totals": summary,
        "cases": [dataclasses.asdict(o) for o in outcomes],
    }
    out = Path(opts.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"structured-suite-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    log(totals_table(summary))
    log(f"{len(outcomes)} requests in {wall_s} s; wrote {path}")
    return result


def _drive(
    target: Target, jobs: list[Job], opts: SuiteOptions, log: Log
) -> tuple[list[Outcome], tuple[str, tuple[str, ...]]]:
    import openai

    models = served_models(target)
    log(f"base {models[0]}, adapters {', '.join(models[1]) or 'none'}; {len(jobs)} requests")
    client = openai.OpenAI(
        base_url=f"{target.base_url}/v1",
        api_key=target.api_key,
        max_retries=0,
        timeout=opts.request_timeout_s,
    )
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=opts.concurrency) as pool:
        futures = [pool.submit(run_job, client, job, models, opts.seed, opts.model) for job in jobs]
        for done, future in enumerate(as_completed(futures), 1):
            o = future.result()
            outcomes.append(o)
            how = f"{o.adapter or 'base'}{', stream' if o.streamed else ''}"
            how += ", sampled" if o.sampled else ""
            verdict = "valid" if o.valid else f"INVALID: {o.error}"
            log(f"[{done}/{len(jobs)}] {o.kind} {o.name} ({how}) {o.seconds:.1f} s: {verdict}")
    order = {(j.kind, j.case.name): i for i, j in enumerate(jobs)}
    outcomes.sort(key=lambda o: order[(o.kind, o.name)])
    return outcomes, models
