"""The operator's adapters on the platform (vLLM's adapter API and ``--lora-resolver-dir``):
checked as uploads are before the engine reads a byte, listed for the operator only, audited;
a resolver-directory adapter is loaded by the first operator request that names it, once,
after the request passed its checks, and never for a tenant or a name outside the directory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from loraplex.platform.auth import Caller
from loraplex.platform.db.models import AuditEvent
from loraplex.platform.settings import ServerSettings
from tests.utils import registry as rf
from tests.utils.registry import RegistryEngine, TinyAdapter, bearer, registry_env
from tests.utils.tenancy import TenancyEnv

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models
CHAT = {"messages": [{"role": "user", "content": "t30"}], "max_tokens": 1}


def write(adapter: TinyAdapter, folder: Path) -> str:
    folder.mkdir(parents=True)
    for name, data in adapter.files().items():
        (folder / name).write_bytes(data)
    return str(folder)


def engine(env: TenancyEnv) -> RegistryEngine:
    assert isinstance(env.fake, RegistryEngine)
    return env.fake


async def chat(
    env: TenancyEnv, model: str, headers: dict[str, str], **extra: Any
) -> httpx.Response:
    return await env.http.post(
        "/v1/chat/completions", json={**CHAT, **extra, "model": model}, headers=headers
    )


@pytest.fixture
async def env(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> AsyncIterator[TenancyEnv]:
    server = ServerSettings(lora_resolver_dir=tmp_path / "loras")
    async with registry_env(
        tmp_path, registry_models, tokenizer, server=server, load_delay=0.05
    ) as env:
        yield env


async def test_a_load_is_checked_like_an_upload_before_the_engine_reads_it(
    env: TenancyEnv, registry_models: rf.RegistryModels, tmp_path: Path
) -> None:
    h = env.admin_headers
    big = registry_models.adapters["a"]
    huge = TinyAdapter(big.config, big.weights + b"\0" * rf.MAX_ADAPTER_BYTES)
    cases = {
        "too-large": (write(huge, tmp_path / "huge"), 413, "too_large"),
        "rank-16": (
            write(registry_models.adapters["r16"], tmp_path / "r16"),
            400,
            "rank_too_large",
        ),
        "missing": (str(tmp_path / "nothing-here"), 400, "missing_file"),
    }
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_bytes(big.config)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not read")
    cases["pickle"] = (str(pickled), 400, "pickle_format")
    for name, (path, status, code) in cases.items():
        r = await env.http.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=h
        )
        assert r.status_code == status, (name, r.text)
        assert r.json()["error"]["code"] == code and r.json()["error"]["param"] == "lora_path"
    assert engine(env).add_lora_calls == []  # every refusal came before the engine


async def test_an_operator_adapter_is_the_operators_and_audited(
    env: TenancyEnv, registry_models: rf.RegistryModels, tmp_path: Path
) -> None:
    h = env.admin_headers
    tenant = bearer(env.tenant("acme"))
    path = write(registry_models.adapters["a"], tmp_path / "op")
    r = await env.http.post("/v1/load_lora_adapter", json={"lora_name": "op", "lora_path": path},
                            headers=h)  # fmt: skip
    assert r.status_code == 200, r.text
    assert (await chat(env, "op", h)).status_code == 200
    assert (await chat(env, "op", tenant)).status_code == 404  # a tenant never sees it
    listed = (await env.http.get("/v1/models", headers=tenant)).json()["data"]
    assert "op" not in {m["id"] for m in listed}
    r = await env.http.post("/v1/unload_lora_adapter", json={"lora_name": "op"}, headers=h)
    assert r.status_code == 200, r.text
    with env.store.db.session() as session:
        query = select(AuditEvent).where(AuditEvent.object_type == "operator_adapter")
        rows = session.scalars(query.order_by(AuditEvent.id)).all()
        audit = [(e.action, e.object_type, e.object_id) for e in rows]
        assert audit == [
            ("operator_adapter.load", "operator_adapter", "op"),
            ("operator_adapter.unload", "operator_adapter", "op"),
        ]
        assert rows[0].after is not None and rows[0].after["lora_path"] == path


async def test_the_resolver_directory_loads_on_the_first_admitted_request_only(
    env: TenancyEnv, registry_models: rf.RegistryModels, tmp_path: Path
) -> None:
    h = env.admin_headers
    path = write(registry_models.adapters["a"], tmp_path / "loras" / "sqlx")
    calls = engine(env).add_lora_calls
    # Refused requests load nothing: a tenant's, a name outside the directory, a bad request.
    assert (await chat(env, "sqlx", bearer(env.tenant("acme")))).status_code == 404
    for outside in ("../loras/sqlx", "loras/sqlx", ".sqlx", "other"):
        assert (await chat(env, outside, h)).status_code == 404, outside
    assert (await chat(env, "sqlx", h, n=1000)).status_code == 400
    assert calls == []
    # Two first uses at once: one load, both served, then listed.
    first = await asyncio.gather(chat(env, "sqlx", h), chat(env, "sqlx", h))
    assert [r.status_code for r in first] == [200, 200], [r.text for r in first]
    assert calls == [("sqlx", path)]
    assert all(r.json()["model"] == "sqlx" for r in first)
    assert engine(env).submitted[-1].lora_key is not None
    models = (await env.http.get("/v1/models", headers=h)).json()["data"]
    assert "sqlx" in {m["id"] for m in models}
    assert (await chat(env, "sqlx", h)).status_code == 200 and len(calls) == 1


async def test_a_bad_resolver_directory_adapter_is_422_for_that_request(
    env: TenancyEnv, registry_models: rf.RegistryModels, tmp_path: Path
) -> None:
    folder = tmp_path / "loras" / "broken"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_bytes(registry_models.adapters["a"].config)
    r = await chat(env, "broken", env.admin_headers)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "missing_file" and error["param"] == "model"
    assert "resolver directory" in error["message"]
    assert engine(env).add_lora_calls == []


async def test_without_the_platform_lora_modules_named_twice_are_one_engine_copy(
    registry_models: rf.RegistryModels, tokenizer: Any, tmp_path: Path
) -> None:
    """KServe names each adapter twice (``--lora-modules``): one load, two names; the copy
    stays until the operator unloads the last name. The resolver directory serves every caller
    of a server without the platform (all are the operator)."""
    from loraplex.server import create_app

    fake = RegistryEngine(model_dir=registry_models.model_dir)
    settings = ServerSettings(lora_resolver_dir=tmp_path / "loras")
    app = create_app(fake, settings, tokenizer=tokenizer)
    path = write(registry_models.adapters["a"], tmp_path / "a")
    write(registry_models.adapters["b"], tmp_path / "loras" / "dirb")
    adapters = app.platform.operator_adapters
    await adapters.load_modules([("a", path), ("publishers/ns/models/a", path)])
    assert fake.add_lora_calls == [("a", path)]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        for model in ("a", "publishers/ns/models/a", "dirb"):
            r = await http.post("/v1/chat/completions", json={**CHAT, "model": model})
            assert r.status_code == 200 and r.json()["model"] == model, r.text
        key = app.platform.resolver.get_adapter(Caller("operator"), "a")
        assert key is not None and key.adapter is not None
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 200 and key.adapter.key in fake.adapters
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "publishers/ns/models/a"})
        assert r.status_code == 200 and key.adapter.key not in fake.adapters
