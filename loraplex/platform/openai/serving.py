"""The completion and chat-completion handlers, as a pipeline in which nothing costly runs before
the request is admitted::

    resolve   the model named (no side effects: no adapter load)            _begin
    admit     the caller's quotas, on a token bound computed without       _admit
              tokenizing (429 here); a lease released when the request ends
    prepare   compile the constraint, render and tokenize the prompt,       (the handlers)
              narrow the lease to the exact estimate, load a cold adapter   _open
    generate  a ``Generation``, answered as JSON or as SSE chunks
    account   what it produced, on the request's record                    account

The lease goes with the request: the quota manager's request-log observer finishes it when the
response ends, whatever the outcome, and a failure while preparing finishes it at once.

Response shapes follow OpenAI's exactly (``cmpl-``/``chatcmpl-`` ids, ``object``, ``created``,
``model``, ``choices``, ``usage``); stream chunks are built as plain dicts so that fields OpenAI
sends as ``null`` are sent as ``null``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from loraplex.engine.client import AdapterNotLoadedError, EngineClient, EngineDeadError
from loraplex.platform.auth import Caller
from loraplex.platform.errors import (
    SERVER_ERROR,
    APIError,
    engine_unavailable,
    invalid_request,
    model_not_found,
)
from loraplex.platform.model_resolver import ModelResolver, ResolvedModel, adapter_failed
from loraplex.platform.openai import logprobs as lp
from loraplex.platform.openai.generation import (
    ADAPTER_FAILED,
    ChoiceEvent,
    EngineRequestError,
    Generation,
    GenerationUsage,
)
from loraplex.platform.openai.params import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    default_max_tokens,
    sampling_params,
    sentence,
)
from loraplex.platform.openai.prompts import Prompts
from loraplex.platform.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    SamplingFields,
    Usage,
)
from loraplex.platform.openai.sse import DONE, SSEResponse, sse
from loraplex.platform.openai.structured import (
    Constraint,
    ConstraintChecker,
    check_schema,
    request_constraint,
)
from loraplex.platform.openai.tools.constraint import with_tools
from loraplex.platform.openai.tools.formats import template_tools
from loraplex.platform.openai.tools.output import StreamedCalls, whole_message
from loraplex.platform.openai.tools.request import ToolPlan, tool_plan
from loraplex.platform.openai.tools.template import ToolPrompt
from loraplex.platform.openai.unsupported import refuse_unsupported
from loraplex.platform.quotas import (
    Lease,
    QuotaManager,
    estimate_bound,
    estimate_tokens,
    text_token_bound,
)
from loraplex.platform.request_log import CLIENT_CLOSED, RequestRecord, request_record
from loraplex.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServingConfig:
    max_n: int = 16  # samples per request
    max_prompts: int = 64  # prompts in one /v1/completions batch
    # max_tokens of a chat request that gives neither max_tokens nor max_completion_tokens
    # (cut to the room the prompt leaves); None: up to the context
    default_max_tokens: int | None = None
    tokenize_threads: int = 4  # prompts rendered and tokenized at once (worker threads)
    grammar_threads: int = 2  # constraints compiled at once (worker threads)


class OpenAIServing:
    def __init__(
        self,
        client: EngineClient,
        resolver: ModelResolver,
        config: ServingConfig,
        tokenizer: Any | None = None,
        *,
        quotas: QuotaManager | None = None,
    ) -> None:
        """``quotas``: the platform's (None: no quotas, the single-operator server)."""
        self.client = client
        self.resolver = resolver
        self.config = config
        self.quotas = quotas
        self._tokenizer = tokenizer
        self._tokenizer_lock = asyncio.Lock()
        self._token_text: dict[int, str] = {}
        self.prompts = Prompts(config.tokenize_threads)
        self.constraints = ConstraintChecker(config.grammar_threads)
        self._special_tokens: dict[bool, int] = {}  # add_special_tokens -> tokens it adds

    async def tokenizer(self) -> Any:
        """The base model's tokenizer, loaded (in a thread) on first use."""
        if self._tokenizer is None:
            async with self._tokenizer_lock:
                if self._tokenizer is None:
                    from transformers import AutoTokenizer

                    model_dir = self.client.info.model_dir
                    self._tokenizer = await anyio.to_thread.run_sync(
                        AutoTokenizer.from_pretrained, model_dir
                    )
        return self._tokenizer

    # ---- /v1/completions ---------------------------------------------------------------------

    async def completions(
        self, body: CompletionRequest, caller: Caller, request: Request
    ) -> CompletionResponse | Response:
        rid = f"cmpl-{uuid.uuid4().hex}"
        record, model = await self._begin(rid, body, caller, request)
        refuse_unsupported(body, "completions")
        items = self._completion_items(body)
        constraint = request_constraint(body)
        tokenizer = await self.tokenizer()
        limit = self.client.info.max_model_len
        specials = self.special_tokens(tokenizer, body.add_special_tokens is not False)
        bounds = [
            text_token_bound(item, specials) if isinstance(item, str) else len(item)
            for item in items
        ]
        max_tokens = body.max_tokens
        default = COMPLETIONS_DEFAULT_MAX_TOKENS  # OpenAI's and vLLM's, not the whole context
        bound = estimate_bound(bounds, body.n or 1, max_tokens or default, limit)
        lease = await self._admit(request, record, caller, bound)
        with _released_on_failure(lease):
            structured = await self._compiled(constraint, tokenizer, caller.tenant_id)
            prompts = await self.prompts.completion(tokenizer, body, items, limit)
            if max_tokens is None:
                max_tokens = default_max_tokens(default, prompts, limit)
            params = self._params(
                body, prompts, "prompt", max_tokens, "max_tokens", body.logprobs, structured
            )
            lease.narrow(estimate_tokens(prompts, params.n, params.max_tokens, limit))
            gen = await self._open(
                rid, prompts, params, model, caller, "prompt", tokenizer, body.priority or 0
            )
        headers = lease.headers
        created = int(time.time())
        want_lp = body.logprobs is not None
        if body.stream:
            include_usage = _include_usage(body)
            events = self._completion_stream(gen, rid, created, model, include_usage, want_lp)
            return SSEResponse(
                self._guarded(events, gen, record, model),
                headers={"X-Request-Id": rid, **headers},
            )
        choices = [_Collected(i) for i in range(gen.num_choices)]
        if not await self._collect(gen, choices, request, record, model):
            return ClientGone()
        return CompletionResponse(
            id=rid,
            created=created,
            model=model.served_name,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.text,
                    logprobs=self._completion_logprobs(c.events, 0) if want_lp else None,
                    finish_reason=c.finish_reason,
                )
                for c in choices
            ],
            usage=_usage(gen.usage),
        )

    def _completion_items(self, body: CompletionRequest) -> list[Any]:
        """The prompts of a completions request: strings or token-id lists."""
        raw = body.prompt
        single = isinstance(raw, str) or (bool(raw) and isinstance(raw[0], int))
        items: list[Any] = [raw] if single else list(raw)
        if not items:
            raise invalid_request(
                "prompt is empty; send a string or a list of token ids.", "prompt", "empty_prompt"
            )
        if len(items) > self.config.max_prompts:
            raise invalid_request(
                f"prompt holds {len(items)} prompts, more than the {self.config.max_prompts} "
                "this server takes in one request; split the batch.",
                "prompt",
                "too_many_prompts",
            )
        return items

    async def _completion_stream(
        self,
        gen: Generation,
        rid: str,
        created: int,
        model: ResolvedModel,
        include_usage: bool,
        want_logprobs: bool,
    ) -> AsyncGenerator[str, None]:
        offsets = [0] * gen.num_choices
        async with contextlib.aclosing(gen.events()) as events:
            async for ev in events:
                logprobs = None
                if want_logprobs:
                    logprobs = self._completion_logprobs([ev], offsets[ev.index])
                offsets[ev.index] += len(ev.text)
                choice = {
                    "index": ev.index,
                    "text": ev.text,
                    "logprobs": logprobs.model_dump() if logprobs else None,
                    "finish_reason": ev.finish_reason,
                }
                yield sse(_chunk(rid, "text_completion", created, model, [choice], include_usage))
        if include_usage:
            yield sse(_usage_chunk(rid, "text_completion", created, model, gen.usage))

    def _completion_logprobs(self, events: list[ChoiceEvent], offset: int) -> CompletionLogprobs:
        """``offset``: where the first event's text starts in the choice's text. A token's offset
        is where its event's text starts (a token's own text may be held back or cut)."""
        out = CompletionLogprobs()
        for ev in events:
            for entry in ev.logprobs:
                out.tokens.append(self._text_of(entry.token_id))
                out.token_logprobs.append(lp.finite(entry.logprob))
                out.top_logprobs.append(
                    {self._text_of(t): lp.finite(v) for t, v in entry.top} or None
                )
                out.text_offset.append(offset)
            offset += len(ev.text)
        return out

    # ---- /v1/chat/completions ----------------------------------------------------------------

    async def chat(
        self, body: ChatCompletionRequest, caller: Caller, request: Request
    ) -> ChatCompletionResponse | Response:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        record, model = await self._begin(rid, body, caller, request)
        refuse_unsupported(body, "chat")
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid_request(
                "top_logprobs needs logprobs: true; set it, or drop top_logprobs.",
                "top_logprobs",
                "invalid_value",
            )
        add_generation_prompt, continue_final_message = _turn_end(body)
        plan = tool_plan(body)
        constraint = request_constraint(body)
        limit = self.client.info.max_model_len
        max_tokens, tokens_param = body.max_tokens, "max_tokens"
        if body.max_completion_tokens is not None:
            max_tokens, tokens_param = body.max_completion_tokens, "max_completion_tokens"
        default = self.config.default_max_tokens  # the operator's (None: up to the context)
        # The template's own text is known only once rendered: the prompt is bounded by the
        # context (see quotas.estimate_bound).
        bound = estimate_bound([limit], body.n or 1, max_tokens or default, limit)
        lease = await self._admit(request, record, caller, bound)
        with _released_on_failure(lease):
            tokenizer = await self.tokenizer()
            template = template_tools(getattr(tokenizer, "chat_template", None))
            structured = await self._compiled(
                with_tools(constraint, plan, template.format), tokenizer, caller.tenant_id
            )
            prompt = await self.prompts.chat(
                tokenizer,
                body,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                max_model_len=limit,
                tools=ToolPrompt(template, plan.tools if plan else ()),
            )
            if max_tokens is None:
                max_tokens = default_max_tokens(default, [prompt], limit)
            top_n = (body.top_logprobs or 0) if body.logprobs else None
            params = self._params(
                body, [prompt], "messages", max_tokens, tokens_param, top_n, structured
            )
            lease.narrow(estimate_tokens([prompt], params.n, params.max_tokens, limit))
            gen = await self._open(
                rid, [prompt], params, model, caller, "messages", tokenizer, body.priority or 0
            )
        headers = lease.headers
        created = int(time.time())
        if body.stream:
            include_usage = _include_usage(body)
            events = self._chat_stream(
                gen, rid, created, model, include_usage, top_n is not None, plan
            )
            return SSEResponse(
                self._guarded(events, gen, record, model),
                headers={"X-Request-Id": rid, **headers},
            )
        choices = [_Collected(i) for i in range(gen.num_choices)]
        if not await self._collect(gen, choices, request, record, model):
            return ClientGone()
        return ChatCompletionResponse(
            id=rid,
            created=created,
            model=model.served_name,
            choices=[
                _chat_choice_of(
                    c, plan, self._chat_logprobs(c.events) if top_n is not None else None
                )
                for c in choices
            ],
            usage=_usage(gen.usage),
        )

    async def _chat_stream(
        self,
        gen: Generation,
        rid: str,
        created: int,
        model: ResolvedModel,
        include_usage: bool,
        want_logprobs: bool,
        plan: ToolPlan | None = None,
    ) -> AsyncGenerator[str, None]:
        kind = "chat.completion.chunk"
        for i in range(gen.num_choices):
            first = _chat_choice(i, {"role": "assistant", "content": ""}, None, None)
            yield sse(_chunk(rid, kind, created, model, [first], include_usage))
        calls = [StreamedCalls(plan) for _ in range(gen.num_choices)] if plan else None
        async with contextlib.aclosing(gen.events()) as events:
            async for ev in events:
                logprobs = self._chat_logprobs([ev]).model_dump() if want_logprobs else None
                finish = ev.finish_reason
                delta: dict[str, Any] | None
                if calls is None:
                    delta = {"content": ev.text} if ev.text else None
                else:  # tool calls parsed out of the text as it comes
                    delta = calls[ev.index].push(ev.text, final=finish is not None)
                    finish = calls[ev.index].finish_reason(finish)
                if delta is None and not finish and not (logprobs and ev.logprobs):
                    continue  # tokens whose text is held back (a partial character or stop)
                if delta is None:
                    delta = {"content": ""} if logprobs else {}
                choice = _chat_choice(ev.index, delta, logprobs, finish)
                yield sse(_chunk(rid, kind, created, model, [choice], include_usage))
        if include_usage:
            yield sse(_usage_chunk(rid, kind, created, model, gen.usage))

    def _chat_logprobs(self, events: list[ChoiceEvent]) -> ChatChoiceLogprobs:
        return ChatChoiceLogprobs(
            content=[lp.chat_entry(e, self._text_of) for ev in events for e in ev.logprobs]
        )

    # ---- the admin console's runs --------------------------------------------------------------

    async def open_console_run(
        self,
        caller: Caller,
        model_name: str,
        text: str,
        *,
        max_tokens: int,
        temperature: float,
        seed: int | None,
        request_id: str,
        schema: Mapping[str, Any] | None = None,
    ) -> ConsoleRun:
        """One prompt the way the API would run it for ``caller`` (the admin UI's playground):
        the model resolved for the caller, ``text`` as a user message through the chat template
        (as plain text when the model has none), tokenized off the event loop with the same
        context checks, ``max_tokens`` cut to the room the prompt leaves; ``schema``: the
        answer is JSON matching it (checked as ``check_console_schema`` does). No quotas: the
        console is the operator's. ``APIError`` says why it cannot run."""
        structured = await self.check_console_schema(schema)
        model = await self.resolver.lookup(caller, model_name)
        if not self.client.healthy:
            raise engine_unavailable()
        tokenizer = await self.tokenizer()
        limit = self.client.info.max_model_len
        if getattr(tokenizer, "chat_template", None):
            chat = ChatCompletionRequest.model_validate(
                {"model": model_name, "messages": [{"role": "user", "content": text}]}
            )
            prompt = await self.prompts.chat(
                tokenizer,
                chat,
                add_generation_prompt=True,
                continue_final_message=False,
                max_model_len=limit,
            )
        else:
            plain = CompletionRequest.model_validate({"model": model_name, "prompt": text})
            [prompt] = await self.prompts.completion(tokenizer, plain, [text], limit)
        room = limit - len(prompt)
        if room < 1:
            raise invalid_request(
                f"The prompt is {len(prompt):,} tokens and the model's context holds "
                f"{limit:,}; shorten the prompt.",
                "prompt",
                "context_length_exceeded",
            )
        params = SamplingParams(
            max_tokens=min(max_tokens, room),
            temperature=temperature,
            seed=seed,
            structured_outputs=structured,
        )
        gen = await self._open(request_id, [prompt], params, model, caller, "prompt", tokenizer)
        return ConsoleRun(model, gen, min(max_tokens, room))

    async def check_console_schema(
        self, schema: Mapping[str, Any] | None
    ) -> StructuredOutputsParams | None:
        """The console's JSON schema as a constraint, bounded and compiled (off the event
        loop); ``APIError`` (param ``schema``) when it is too large or cannot be enforced."""
        if schema is None:
            return None
        check_schema(schema, "schema")
        constraint = Constraint(StructuredOutputsParams(json=dict(schema)), "schema")
        return await self._compiled(constraint, await self.tokenizer())

    # ---- shared ------------------------------------------------------------------------------

    async def _begin(
        self, rid: str, body: SamplingFields, caller: Caller, request: Request
    ) -> tuple[RequestRecord, ResolvedModel]:
        record = request_record(request)
        record.request_id, record.caller, record.model = rid, caller.id, body.model
        record.user, record.stream = body.user, bool(body.stream)
        record.tenant_id, record.key_id = caller.tenant_id, caller.key_id
        model = await self.resolver.lookup(caller, body.model)
        record.served_model, record.lora_key = model.served_name, model.lora_key
        record.adapter_version_id = model.adapter_version_id
        check_priority_allowed(body.priority or 0, caller)
        if not self.client.healthy:
            raise engine_unavailable()
        return record, model

    async def _admit(
        self, request: Request, record: RequestRecord, caller: Caller, bound: int
    ) -> Lease:
        """Take the caller's quotas (429 when over) for a request of at most ``bound`` tokens,
        before anything that costs; the lease is finished by the quota manager's request
        observer when the request ends (``_released_on_failure`` finishes it at once when the
        request fails before its response). Its ``x-ratelimit-*`` headers go on the response."""
        lease = await self.admit(caller, bound, record=record)
        request.state.rate_limit_headers = lease.headers
        return lease

    async def admit(
        self, caller: Caller, bound: int, *, record: RequestRecord | None = None
    ) -> Lease:
        """The caller's quota lease for ``bound`` tokens (429 when over); a lease that holds
        nothing where this server has no quotas."""
        if self.quotas is None:
            return Lease(None, None, 0, {})
        return await self.quotas.admit(caller, bound, record=record)

    def special_tokens(self, tokenizer: Any, add_special_tokens: bool) -> int:
        """How many special tokens (BOS, EOS) the tokenizer adds to a text; a text prompt's
        token bound counts them (``text_token_bound``)."""
        count = self._special_tokens.get(add_special_tokens)
        if count is None:
            count = 0
            measure = getattr(tokenizer, "num_special_tokens_to_add", None)
            if add_special_tokens and measure is not None:
                count = int(measure(pair=False))
            elif add_special_tokens:
                count = self.client.info.max_model_len  # unknown: the context bounds it
            self._special_tokens[add_special_tokens] = count
        return count

    async def _compiled(
        self, constraint: Constraint | None, tokenizer: Any, tenant: str | None = None
    ) -> StructuredOutputsParams | None:
        """The constraint, compiled once with the served tokenizer in a worker thread (in
        ``tenant``'s line): a 400 here for what the backend cannot enforce, before the request
        reaches the engine."""
        if constraint is None:
            return None
        await self.constraints.check(constraint, tokenizer, tenant)
        return constraint.params

    def _params(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        prompt_param: str,
        max_tokens: int | None,
        tokens_param: str,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        return sampling_params(
            body,
            prompts,
            prompt_param=prompt_param,
            max_tokens=max_tokens,
            tokens_param=tokens_param,
            logprobs=logprobs,
            max_n=self.config.max_n,
            max_model_len=self.client.info.max_model_len,
            vocab_size=self.client.info.vocab_size,
            structured=structured,
        )

    async def _open(
        self,
        rid: str,
        prompts: list[list[int]],
        params: SamplingParams,
        model: ResolvedModel,
        caller: Caller,
        prompt_param: str,
        tokenizer: Any,
        priority: int = 0,
    ) -> Generation:
        """The request's generation, its adapter loaded first if the engine lacks it (only
        here, after admission: a refused request never loads one)."""
        model = await model.prepare()  # an adapter found on demand gets its key
        try:
            return Generation(
                self.client,
                tokenizer,
                rid,
                prompts,
                params,
                lora_key=model.lora_key,
                cache_extra_keys=model.cache_extra_keys,
                tenant=caller.tenant_id,  # the engine's fair policy schedules by tenant
                priority=priority,
            )
        except AdapterNotLoadedError:  # deleted since it was resolved: as if it never was
            raise model_not_found(model.served_name) from None
        except ValueError as exc:  # the engine's own checks (token ids, KV cache size)
            message = str(exc)
            param = prompt_param if message.startswith("prompt") else None
            raise invalid_request(sentence(message), param, "invalid_prompt") from None

    async def _collect(
        self,
        gen: Generation,
        choices: list[_Collected],
        request: Request,
        record: RequestRecord,
        model: ResolvedModel,
    ) -> bool:
        """Runs ``gen`` to the end into ``choices``; False when the client left first (the
        engine request is then aborted)."""

        async def run() -> None:
            async with contextlib.aclosing(gen.events()) as events:
                async for ev in events:
                    choices[ev.index].add(ev)

        try:
            return await _until_disconnect(request, run)
        except AdapterNotLoadedError:  # deleted before the request reached the engine
            raise adapter_gone() from None
        except EngineRequestError as exc:
            raise engine_request_error(exc, model) from None
        finally:
            account(record, gen)

    async def _guarded(
        self,
        events: AsyncGenerator[str, None],
        gen: Generation,
        record: RequestRecord,
        model: ResolvedModel,
    ) -> AsyncGenerator[str, None]:
        """SSE events, then ``[DONE]``; an error after the stream started (the engine died, say)
        becomes a last ``data: {"error": ...}`` event before ``[DONE]``."""
        try:
            async with contextlib.aclosing(events) as it:
                async for chunk in it:
                    yield chunk
        except Exception as exc:
            error = _stream_error(exc, model)
            record.error_code, record.stream_error_status = error.code, error.status
            yield sse(error.body())
        finally:
            account(record, gen)
        yield DONE

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            assert self._tokenizer is not None
            text = self._tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text


@dataclass(frozen=True)
class ConsoleRun:
    """A console prompt, opened (the engine request starts at its first event)."""

    model: ResolvedModel
    generation: Generation
    max_tokens: int


class ClientGone(Response):
    """The answer to a client that left before its response was ready: nothing is sent (the
    request log records status 499)."""

    def __init__(self) -> None:
        super().__init__(status_code=CLIENT_CLOSED)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return


@dataclass
class _Collected:
    """One choice of a non-streamed response, gathered from its events."""

    index: int
    events: list[ChoiceEvent] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, ev: ChoiceEvent) -> None:
        self.events.append(ev)
        self.finish_reason = ev.finish_reason or self.finish_reason

    @property
    def text(self) -> str:
        return "".join(ev.text for ev in self.events)


def _chat_choice_of(
    collected: _Collected, plan: ToolPlan | None, logprobs: ChatChoiceLogprobs | None
) -> ChatChoice:
    """A non-streamed choice: its text, or with tools its content and parsed calls."""
    message = ChatResponseMessage(content=collected.text)
    finish = collected.finish_reason
    if plan is not None:
        message, finish = whole_message(collected.text, finish, plan)
    return ChatChoice(
        index=collected.index, message=message, logprobs=logprobs, finish_reason=finish
    )


def _turn_end(body: ChatCompletionRequest) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) of a chat request, as vLLM reads them:
    the generation prompt is on unless the final message is continued; asking for both is a
    400."""
    continue_final = bool(body.continue_final_message)
    explicit = "add_generation_prompt" in body.model_fields_set
    if continue_final and explicit and body.add_generation_prompt:
        raise invalid_request(
            "add_generation_prompt: true opens a new assistant turn, while "
            "continue_final_message: true continues the last message; set only one of them.",
            "continue_final_message",
            "invalid_value",
        )
    add_generation = body.add_generation_prompt is not False and not continue_final
    return add_generation, continue_final


@contextlib.contextmanager
def _released_on_failure(lease: Lease) -> Iterator[None]:
    """Finishes ``lease``, charging nothing, when the block raises (a 4xx/5xx before the
    engine ran anything): its concurrency slot and reservation are back at once. The request
    observer's later ``finish`` is then a no-op."""
    try:
        yield
    except BaseException:
        lease.finish(0)
        raise


def _include_usage(body: SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _usage(usage: GenerationUsage) -> Usage:
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def _chunk(
    rid: str,
    kind: str,
    created: int,
    model: ResolvedModel,
    choices: list[dict[str, Any]],
    include_usage: bool,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model.served_name,
        "choices": choices,
    }
    if include_usage:
        chunk["usage"] = None  # OpenAI: every chunk but the last has "usage": null
    return chunk


def _usage_chunk(
    rid: str, kind: str, created: int, model: ResolvedModel, usage: GenerationUsage
) -> dict[str, Any]:
    chunk = _chunk(rid, kind, created, model, [], False)
    chunk["usage"] = _usage(usage).model_dump()
    return chunk


def _chat_choice(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def check_priority_allowed(priority: int, caller: Caller) -> None:
    """400 when ``priority`` is more urgent (lower) than the caller's tenant may ask for."""
    limit = caller.max_priority
    if limit is not None and priority < limit:
        raise invalid_request(
            f"priority {priority} is more urgent than this tenant may ask for: its limit "
            f"(max_priority) is {limit}, and lower runs earlier. Send a priority of {limit} or "
            "more, or ask the operator to raise the tenant's max_priority.",
            "priority",
            "priority_not_allowed",
        )


def adapter_gone() -> APIError:
    """The request's adapter was deleted before the engine ran it (never the engine's key)."""
    return APIError(
        404,
        "The adapter this request names was deleted before the request ran; GET /v1/models "
        "lists the models you can use.",
        param="model",
        code="model_not_found",
    )


CONSTRAINT_TOO_COSTLY = "constraint_too_costly"  # the engine's error_code: mask work over bound


def engine_request_error(exc: EngineRequestError, model: ResolvedModel) -> APIError:
    """The answer to a request the engine ended with an error: its adapter's fault, or a
    constraint's."""
    if exc.code == ADAPTER_FAILED:
        return adapter_failed(model.served_name, failure_cause(str(exc)))
    if exc.code == CONSTRAINT_TOO_COSTLY:
        return APIError(
            422,
            f"This request's output constraint was stopped: {sentence(str(exc))} The engine "
            "bounds the work a constraint may cost every other request each token.",
            code=CONSTRAINT_TOO_COSTLY,
        )
    return request_failed(exc)


def failure_cause(engine_error: str) -> str:
    """The cause in the engine's ``adapter 'tenant/name@N' could not be loaded: <cause>``,
    without the engine's name of the adapter: content shared by two tenants is registered under
    the first one's name, which the other must not see. Nothing else is passed on (no content
    hash: the engine's other wordings may hold one)."""
    _, sep, cause = engine_error.partition(" could not be loaded: ")
    cause = cause.strip().rstrip(".") if sep else ""
    return cause or "the engine could not load it"


def request_failed(exc: EngineRequestError) -> APIError:
    """The engine could not serve the request (a constraint that passed the platform's check
    failed in the engine): a server error, and the engine serves on."""
    logger.warning("the engine failed a request: %s", exc)
    return APIError(
        500,
        f"The engine could not finish this request: {sentence(str(exc))} Its output "
        "constraint passed the server's checks but failed in the engine (a server bug, not "
        "your input); other requests are unaffected. Retry, or send the request without its "
        "constraint.",
        type=SERVER_ERROR,
        code="structured_output_failed",
    )


def _stream_error(exc: Exception, model: ResolvedModel) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc) or "it stopped")
    if isinstance(exc, AdapterNotLoadedError):
        return adapter_gone()
    if isinstance(exc, EngineRequestError):
        return engine_request_error(exc, model)
    if isinstance(exc, ValueError):
        return invalid_request(sentence(str(exc)), code="invalid_request")
    logger.exception("internal error in a stream")
    return APIError(
        500,
        "The server failed while streaming this response (a bug, not your input); the "
        "operator can find the traceback in the server log.",
        type=SERVER_ERROR,
        code="internal_error",
    )


def account(record: RequestRecord, gen: Generation) -> None:
    """What ``gen`` produced, on its request's record (usage rows, metrics, the request log)."""
    record.prompt_tokens = gen.usage.prompt_tokens
    record.completion_tokens = gen.usage.completion_tokens
    record.cached_tokens = gen.usage.cached_tokens
    record.finish_reasons = [f or "none" for f in gen.finish_reasons]
    record.generated = True
    record.first_token_time = gen.first_token_time
    record.time_per_output_token = gen.time_per_output_token
    record.queue_time = gen.queue_time


async def _until_disconnect(request: Request, work: Callable[[], Awaitable[None]]) -> bool:
    """Runs ``work``; cancels it when the client disconnects first (returns False then).
    Exceptions of ``work`` propagate unchanged (not wrapped in an ExceptionGroup)."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()  # re-raises what ``work`` raised
    return True


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
