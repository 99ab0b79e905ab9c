"""Admission before work: a request the tenant's quotas refuse costs nothing (issue 30 point 4,
issue 31 point 1). Resolving ``model`` loads no adapter; the 429 comes before any constraint
compile, any tokenizer call and any adapter load; ``/tokenize`` and ``/detokenize`` take the
same quotas; the reservation taken on a bound before tokenizing is narrowed to the exact
estimate after it; a request that fails after admission gives its slot back at once."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from loraplex.platform.auth import Caller
from loraplex.platform.db.models import QuotaLease
from loraplex.platform.quota_db import DatabaseQuotaStore
from loraplex.platform.quotas import (
    Limits,
    MemoryQuotaStore,
    QuotaManager,
    QuotaStore,
    estimate_bound,
    estimate_tokens,
)
from loraplex.platform.tenants import Quotas
from tests.utils import registry as rf
from tests.utils.registry import registry_env, upload
from tests.utils.tenancy import TenancyEnv, bearer, platform_for

pytestmark = pytest.mark.anyio
registry_models = rf.registry_models

BASE = "tiny-chat"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
LARGE = "t30 " * 250_000  # a megabyte of text


def _chat(model: str = BASE, content: str = "t30", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def _completion(prompt: str | list[str] = "t30 t31", **extra: Any) -> dict[str, Any]:
    return {"model": BASE, "prompt": prompt, "max_tokens": 2, **extra}


async def _post(env: TenancyEnv, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return await env.http.post(path, json=body, headers=bearer(key))


def _refused(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert "requests per minute" in r.json()["error"]["message"]


class TokenizerCalls:
    """Counts every call into the tokenizer's class that turns text into tokens or renders a
    conversation (``__call__``, ``encode``, ``apply_chat_template``) or decodes ids."""

    def __init__(self, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        cls = type(tokenizer)
        for name in ("__call__", "encode", "apply_chat_template", "decode"):
            monkeypatch.setattr(cls, name, self._counting(name, getattr(cls, name)))

    def _counting(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return fn(*args, **kwargs)

        return counted


def _count_compiles(env: TenancyEnv, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The constraints the platform's checker compiles (``ConstraintChecker.check``)."""
    checker = env.app.platform.serving.constraints
    compiled: list[Any] = []
    check = checker.check

    async def counting(constraint: Any, tokenizer: Any, tenant: Any = None) -> None:
        compiled.append(constraint)
        await check(constraint, tokenizer, tenant)

    monkeypatch.setattr(checker, "check", counting)
    return compiled


# ---- adapters: resolving loads nothing, a refused request loads nothing ------------------------


@pytest.fixture
async def adapters_env(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> AsyncIterator[TenancyEnv]:
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        yield env


async def _cold_adapter(env: TenancyEnv, key: str, models: rf.RegistryModels) -> str:
    """Upload adapter "x" for the tenant of ``key`` and make the engine lose it (cold: its next
    use loads it again); returns its content hash."""
    r = await upload(env.http, key, "x", models.adapters["a"].files())
    assert r.status_code == 201, r.text
    content = str(r.json()["versions"][0]["content_sha256"])
    env.fake.lose_adapter(content)
    return content


async def test_a_refused_request_on_a_cold_adapter_loads_nothing(
    adapters_env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    env = adapters_env
    engine = env.fake
    assert isinstance(engine, rf.RegistryEngine)
    key = env.tenant("acme", quotas=Quotas(requests_per_minute=1))
    content = await _cold_adapter(env, key, registry_models)
    loads = len(engine.add_lora_calls)
    assert (await _post(env, key, "/v1/chat/completions", _chat(max_tokens=1))).status_code == 200
    for stream in (False, True):  # the minute's one request is spent
        r = await _post(env, key, "/v1/chat/completions", _chat("x", max_tokens=1, stream=stream))
        _refused(r)
    assert len(engine.add_lora_calls) == loads  # before: resolving "x" loaded it first
    assert content not in engine.adapters


async def test_an_admitted_request_loads_its_cold_adapter_and_tokenize_loads_none(
    adapters_env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    """/tokenize names the adapter only for its tokenizer (the base model's): nothing to load.
    The first completion on the cold adapter loads it, once, after admission."""
    env = adapters_env
    engine = env.fake
    assert isinstance(engine, rf.RegistryEngine)
    key = env.tenant("acme")
    content = await _cold_adapter(env, key, registry_models)
    loads = len(engine.add_lora_calls)
    r = await _post(env, key, "/tokenize", {"model": "x", "prompt": "t30 t31"})
    assert r.status_code == 200, r.text
    assert len(engine.add_lora_calls) == loads  # before: resolving "x" loaded it
    r = await _post(env, key, "/v1/chat/completions", _chat("x", max_tokens=1))
    assert r.status_code == 200, r.text
    assert len(engine.add_lora_calls) == loads + 1 and content in engine.adapters
    assert engine.submitted[-1].lora_key == content


# ---- constraints and tokenization come after the 429 -------------------------------------------


async def test_a_refused_request_compiles_no_constraint(
    tenancy: TenancyEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = tenancy
    compiled = _count_compiles(env, monkeypatch)
    key = env.tenant("acme", quotas=Quotas(requests_per_minute=1))
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    # Admitted: its constraint is compiled (the tiny WordPiece tokenizer cannot serve
    # structured output: a 400 after admission, which spends the minute's one request).
    r = await _post(env, key, "/v1/chat/completions", _chat(max_tokens=8, response_format=schema))
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"], r.text
    assert len(compiled) == 1
    for path, body in (
        ("/v1/chat/completions", _chat(max_tokens=8, response_format=schema)),
        ("/v1/completions", _completion(structured_outputs={"json": SCHEMA})),
        ("/v1/chat/completions", _chat(max_tokens=8, guided_regex="[a-z]+")),
    ):
        _refused(await _post(env, key, path, body))
    assert len(compiled) == 1  # before: every refused request compiled first


async def test_a_refused_request_tokenizes_nothing(
    tenancy: TenancyEnv, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = tenancy
    key = env.tenant("acme", quotas=Quotas(requests_per_minute=1))
    assert (await _post(env, key, "/v1/completions", _completion())).status_code == 200
    counted = TokenizerCalls(tokenizer, monkeypatch)
    for path, body in (
        ("/v1/completions", _completion()),
        ("/v1/completions", _completion(LARGE)),
        ("/v1/completions", _completion(["t30 t31", LARGE])),
        ("/v1/chat/completions", _chat(content=LARGE, max_tokens=2)),
        ("/v1/chat/completions", _chat(max_tokens=2, stream=True)),
        ("/tokenize", {"model": BASE, "prompt": LARGE}),
        ("/tokenize", {"model": BASE, "messages": [{"role": "user", "content": LARGE}]}),
        ("/detokenize", {"model": BASE, "tokens": [30, 31]}),
    ):
        _refused(await _post(env, key, path, body))
    assert counted.calls == []  # before: each was rendered or tokenized, then refused


async def test_tokenize_and_detokenize_count_against_the_quotas(tenancy: TenancyEnv) -> None:
    """Requests/minute: /tokenize and /detokenize are requests. Tokens/minute: charged the
    tokens they return."""
    env = tenancy
    key = env.tenant("acme", quotas=Quotas(requests_per_minute=2))
    assert (await _post(env, key, "/tokenize", {"model": BASE, "prompt": "t30"})).status_code == 200
    r = await _post(env, key, "/detokenize", {"model": BASE, "tokens": [30]})
    assert r.status_code == 200, r.text
    _refused(await _post(env, key, "/v1/completions", _completion()))  # the minute is spent

    tight = env.tenant("globex", quotas=Quotas(tokens_per_minute=50))
    prompt = " ".join(f"t{30 + i % 40}" for i in range(60))
    r = await _post(env, tight, "/tokenize", {"model": BASE, "prompt": prompt})
    assert r.status_code == 200 and r.json()["count"] >= 50, r.text
    r = await _post(env, tight, "/detokenize", {"model": BASE, "tokens": [30]})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "tokens"
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"


async def test_a_request_failing_after_admission_gives_its_slot_back(
    tenancy: TenancyEnv,
) -> None:
    """Refused after admission (an unenforceable schema, a prompt over the context, a bad
    parameter): its concurrency slot is free again, and it was charged no tokens."""
    env = tenancy
    key = env.tenant("acme", quotas=Quotas(max_concurrent_requests=1, tokens_per_minute=500))
    bad_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "x"}}}
    failing = (
        ("/v1/chat/completions", _chat(max_tokens=2, response_format=bad_schema)),
        ("/v1/completions", _completion(" ".join(["t30"] * 200))),
        ("/v1/completions", _completion(max_tokens=10_000)),
        ("/v1/chat/completions", _chat("x", max_tokens=2)),  # 404: refused before admission
        ("/tokenize", {"model": BASE, "messages": []}),
        ("/detokenize", {"model": BASE, "tokens": [10**6]}),
    )
    for path, body in failing:
        r = await _post(env, key, path, body)
        assert 400 <= r.status_code < 500 and r.status_code != 429, (path, r.text)
    assert env.app.platform.tenancy is not None
    assert env.app.platform.tenancy.quotas.in_flight(int(_tenant_id(env, "acme"))) == 0
    r = await _post(env, key, "/v1/completions", _completion())
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-remaining-tokens"] != "0"


def _tenant_id(env: TenancyEnv, name: str) -> str:
    from loraplex.platform import tenants

    with env.store.db.session() as session:
        return str(tenants.require_tenant(session, name).id)


# ---- the bound, and narrowing it ---------------------------------------------------------------


def test_the_admission_bound_covers_every_prompt_it_allows() -> None:
    """``estimate_bound`` is at least ``estimate_tokens`` for every prompt length up to the
    bound (and below the context), and equal at the worst one."""
    limit = 40
    for bound, n, max_tokens in itertools.product(
        (0, 1, 5, 39, 40, 1000), (1, 2, 5), (None, 1, 7, 39, 40, 100)
    ):
        lengths = range(1, min(bound, limit - 1) + 1)
        worst = max((estimate_tokens([[0] * p], n, max_tokens, limit) for p in lengths), default=0)
        got = estimate_bound([bound], n, max_tokens, limit)
        assert got >= worst, (bound, n, max_tokens)
        assert got <= worst + n * limit, (bound, n, max_tokens)  # never far above the worst
    assert estimate_bound([10, 20], 1, 5, 64) == 15 + 25


@pytest.fixture(params=["memory", "database"])
async def manager(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[QuotaManager, Caller, Callable[[], list[int]]]]:
    """A quota manager on each store, a tenant's caller, and the reservations its store holds
    (the open leases' estimates)."""
    if request.param == "memory":
        memory = MemoryQuotaStore()
        caller = Caller(id="t", tenant_id="1")
        yield (
            QuotaManager(None, store=memory),
            caller,
            lambda: [memory._tenants[1].reserved] if 1 in memory._tenants else [0],
        )
        return
    from loraplex.platform import tenants

    store = platform_for(tmp_path)
    with store.db.session() as session:
        tenant_id = tenants.create_tenant(session, "admin", "acme").id
    database: QuotaStore = DatabaseQuotaStore(store.db)

    def reserved() -> list[int]:
        def read(session: Any) -> list[int]:
            open_leases = QuotaLease.finished_at.is_(None)
            total = select(func.coalesce(func.sum(QuotaLease.estimated_tokens), 0))
            return [int(session.scalar(total.where(open_leases)))]

        return store.db.call(read)

    try:
        yield QuotaManager(None, store=database), Caller(id="t", tenant_id=str(tenant_id)), reserved
    finally:
        await database.close()
        store.db.dispose()


async def test_a_lease_narrows_to_the_exact_estimate(
    manager: tuple[QuotaManager, Caller, Callable[[], list[int]]],
) -> None:
    quotas, caller, reserved = manager
    limits = Limits(tokens_per_minute=1000)
    lease = await quotas.admit(caller, 900, limits=limits)  # the bound, before tokenizing
    lease.narrow(120)  # the exact estimate, after
    lease.narrow(500)  # never raised again
    await quotas.store.close()
    assert reserved() == [120]
    second = await quotas.admit(caller, 100, limits=limits)  # 900 + 100 would have refused
    assert second.headers["x-ratelimit-remaining-tokens"] == str(1000 - 120 - 100)
    lease.finish(30)
    second.finish(0)
    await quotas.store.close()
    assert reserved() == [0]
