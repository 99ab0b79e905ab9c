"""Adapter uploads: the happy path through versions and deletes, and every attack refused with
its own 4xx while leaving nothing behind, on disk or in the database."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from loraplex.platform import tenants
from loraplex.platform.auth import SCOPE_INFERENCE
from loraplex.platform.db.models import AdapterVersion, AuditEvent, UsageRecord
from tests.utils import registry as rf
from tests.utils.registry import (
    CONFIG,
    WEIGHTS,
    bearer,
    disk_state,
    lying_header,
    make_tgz,
    make_zip,
    registry_env,
    row_counts,
    upload,
)
from tests.utils.tenancy import ADMIN_TOKEN, TenancyEnv

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models
BASE = "tiny-chat"


@pytest.fixture
async def env(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> AsyncIterator[TenancyEnv]:
    """On SQLite only: for checks of files and requests, not of the database."""
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        yield env


@pytest.fixture
async def db_env(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any, database_url: str | None
) -> AsyncIterator[TenancyEnv]:
    """On SQLite and on PostgreSQL (skipped where it is not installed)."""
    async with registry_env(tmp_path, registry_models, tokenizer, database_url=database_url) as env:
        yield env


async def chat(env: TenancyEnv, token: str, model: str) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "t30 t31"}], "max_tokens": 2}
    return await env.http.post("/v1/chat/completions", json=body, headers=bearer(token))


def audit_actions(env: TenancyEnv) -> list[tuple[str, str, str]]:
    def read(session: Any) -> list[tuple[str, str, str]]:
        rows = session.scalars(select(AuditEvent).order_by(AuditEvent.id))
        return [(e.action, e.object_id, e.actor) for e in rows if e.action.startswith("adapter")]

    return env.store.db.call(read)


async def test_upload_versions_select_and_delete(
    db_env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    env = db_env
    a, b = registry_models.adapters["a"], registry_models.adapters["b"]
    token = env.tenant("acme")
    engine = env.fake
    assert isinstance(engine, rf.RegistryEngine)

    r = await upload(env.http, token, "bot", a.files(), description="first")
    assert r.status_code == 201, r.text
    card = r.json()
    assert str(env.store.data_dir) not in r.text and "adapters/" not in r.text  # no paths
    assert (card["id"], card["owned_by"], card["parent"]) == ("bot", "acme", BASE)
    assert (card["description"], card["latest_version"]) == ("first", 1)
    (v1,) = card["versions"]
    assert v1["id"] == "bot@1" and v1["status"] == "ready"
    assert (v1["rank"], v1["alpha"], v1["target_modules"]) == (4, 8.0, ["q_proj", "v_proj"])
    key_a = v1["content_sha256"]
    assert key_a in engine.adapters and len(engine.add_lora_calls) == 1  # loaded once: ready
    assert v1["size_bytes"] == len(a.config) + len(a.weights)
    assert (env.store.data_dir / "adapters" / key_a / WEIGHTS).read_bytes() == a.weights

    for model in ("bot", "bot@1"):
        r = await chat(env, token, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "bot@1"
        assert engine.submitted[-1].lora_key == key_a
    await env.app.platform.tenancy.usage.flush()  # usage rows name the exact version that served

    def usage(session: Any) -> list[tuple[str, int | None]]:
        rows = session.scalars(select(UsageRecord).order_by(UsageRecord.id))
        return [(u.model, u.adapter_version_id) for u in rows]

    version_id = env.store.db.call(lambda s: s.scalars(select(AdapterVersion.id)).one())
    assert env.store.db.call(usage) == [("bot@1", version_id)] * 2

    r = await upload(env.http, token, "bot", b.files())
    assert r.status_code == 201, r.text
    assert [v["id"] for v in r.json()["versions"]] == ["bot@1", "bot@2"]
    assert r.json()["latest_version"] == 2 and r.json()["description"] == "first"
    key_b = r.json()["versions"][1]["content_sha256"]
    assert key_b != key_a
    r = await chat(env, token, "bot")
    assert r.json()["model"] == "bot@2" and engine.submitted[-1].lora_key == key_b

    r = await env.http.get("/v1/models", headers=bearer(token))
    cards = {m["id"]: m for m in r.json()["data"]}
    assert set(cards) == {BASE, "bot", "bot@1", "bot@2"}
    assert cards["bot@1"]["parent"] == BASE and cards["bot@1"]["owned_by"] == "acme"
    assert str(env.store.data_dir) not in r.text

    r = await env.http.delete("/v1/adapters/bot@1", headers=bearer(token))
    assert r.json() == {"id": "bot@1", "object": "adapter.version", "deleted": True}
    assert (await chat(env, token, "bot@1")).status_code == 404
    r = await chat(env, token, "bot")
    assert r.json()["model"] == "bot@2" and engine.submitted[-1].lora_key == key_b
    assert not (env.store.data_dir / "adapters" / key_a).exists()  # no version names it
    assert engine.removed == [key_a]

    r = await env.http.delete("/v1/adapters/bot", headers=bearer(token))
    assert r.json() == {"id": "bot", "object": "adapter", "deleted": True}
    r = await chat(env, token, "bot")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert (await env.http.get("/v1/adapters/bot", headers=bearer(token))).status_code == 404
    assert row_counts(env) == (0, 0)
    assert not any(p.startswith("adapters/") for p in disk_state(env))

    actions = audit_actions(env)
    assert [(a, o) for a, o, _ in actions] == [
        ("adapter.upload", "bot@1"),
        ("adapter.upload", "bot@2"),
        ("adapter_version.delete", "bot@1"),
        ("adapter.delete", "bot"),
    ]
    assert all(actor.startswith("tenant:acme/key:") for _, _, actor in actions)


async def test_archives_give_the_same_content_hash(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    a = registry_models.adapters["a"]
    token = env.tenant("acme")
    engine = env.fake
    assert isinstance(engine, rf.RegistryEngine)
    nested = {f"my-adapter/{k}": v for k, v in a.files().items()}
    nested["my-adapter/README.md"] = b"# notes"
    keys = []
    for name, files in (
        ("plain", a.files()),
        ("zipped", {"adapter.zip": make_zip(nested)}),
        ("tarred", {"adapter.tar.gz": make_tgz(nested)}),
    ):
        r = await upload(env.http, token, name, files)
        assert r.status_code == 201, r.text
        keys.append(r.json()["versions"][0]["content_sha256"])
    assert len(set(keys)) == 1
    assert len(engine.add_lora_calls) == 1  # one engine copy for the three names
    stored = [p for p in disk_state(env) if p.startswith("adapters/")]
    assert sorted(stored) == [f"adapters/{keys[0]}/{CONFIG}", f"adapters/{keys[0]}/{WEIGHTS}"]
    assert not any(p.startswith("tmp/") for p in disk_state(env))


def _nan(adapter: rf.TinyAdapter) -> rf.TinyAdapter:
    tensors = adapter.tensors()
    name = next(n for n in sorted(tensors) if "lora_B" in n)
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = float("nan")
    return adapter.with_tensors(tensors)


def _wrong_shapes(adapter: rf.TinyAdapter) -> rf.TinyAdapter:
    import torch

    tensors = adapter.tensors()
    name = next(n for n in sorted(tensors) if "q_proj.lora_A" in n)
    rank = tensors[name].shape[0]
    tensors[name] = torch.randn(rank, 32)  # the base model's q_proj takes 64 features
    return adapter.with_tensors(tensors)


def _attack(case: str, models: rf.RegistryModels) -> dict[str, bytes]:
    a = models.adapters["a"]
    nested = {f"x/{k}": v for k, v in a.files().items()}
    if case == "pickle_bin":
        return {CONFIG: a.config, "adapter_model.bin": b"\x80\x04\x95" + b"\x00" * 64}
    if case == "pickle_in_zip":
        return {"a.zip": make_zip({"x/adapter_config.json": a.config, "x/adapter_model.bin": b"x"})}
    if case == "lying_header":
        return {CONFIG: a.config, WEIGHTS: lying_header(a.weights)}
    if case == "wrong_shapes":
        return _wrong_shapes(a).files()
    if case == "rank_over_limit":
        return models.adapters["r16"].files()
    if case == "unsupported_targets":
        return a.with_config(target_modules=["q_proj", "v_proj", "lm_head"]).files()
    if case == "nan_weights":
        return _nan(a).files()
    if case == "zip_dotdot":
        return {"a.zip": make_zip({f"../{k}": v for k, v in a.files().items()})}
    if case == "zip_absolute":
        return {"a.zip": make_zip({f"/tmp/x/{k}": v for k, v in a.files().items()})}
    if case == "tar_absolute":
        return {"a.tar.gz": make_tgz({f"/tmp/x/{k}": v for k, v in a.files().items()})}
    if case == "zip_symlink":
        return {
            "a.zip": make_zip(
                {"x/adapter_config.json": a.config}, symlinks={f"x/{WEIGHTS}": "/etc/passwd"}
            )
        }
    if case == "zip_bomb":
        return {"a.zip": make_zip({**nested, "x/padding.bin.txt": bytes(16 << 20)})}
    if case == "oversized":
        return {CONFIG: a.config, WEIGHTS: os.urandom(rf.MAX_ADAPTER_BYTES + 4096)}
    raise AssertionError(case)


ATTACKS = [
    ("pickle_bin", 400, "pickle_format"),
    ("pickle_in_zip", 400, "pickle_format"),
    ("lying_header", 400, "bad_safetensors"),
    ("wrong_shapes", 400, "base_model_mismatch"),
    ("rank_over_limit", 400, "rank_too_large"),
    ("unsupported_targets", 400, "unsupported_target"),
    ("nan_weights", 400, "nan_weights"),
    ("zip_dotdot", 400, "unsafe_archive_member"),
    ("zip_absolute", 400, "unsafe_archive_member"),
    ("tar_absolute", 400, "unsafe_archive_member"),
    ("zip_symlink", 400, "unsafe_archive_member"),
    ("zip_bomb", 413, "archive_too_large"),
    ("oversized", 413, "adapter_too_large"),
]


@pytest.mark.parametrize(("case", "status", "code"), ATTACKS, ids=[c for c, _, _ in ATTACKS])
async def test_attack_refused_leaving_nothing(
    env: TenancyEnv, registry_models: rf.RegistryModels, case: str, status: int, code: str
) -> None:
    token = env.tenant("acme")
    before = disk_state(env)
    r = await upload(env.http, token, "victim", _attack(case, registry_models))
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert r.json()["error"]["message"].endswith("."), r.text
    assert disk_state(env) == before
    assert list((env.store.data_dir / "tmp").iterdir()) == []
    assert row_counts(env) == (0, 0)
    assert (await chat(env, token, "victim")).status_code == 404


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("a/b", "invalid_adapter_name"),
        ("../escape", "invalid_adapter_name"),
        ("a\\b", "invalid_adapter_name"),
        ("bad\nname", "invalid_adapter_name"),
        ("bad\x01name", "invalid_adapter_name"),
        ("tab\tname", "invalid_adapter_name"),
        ("v@2", "invalid_adapter_name"),
        (".hidden", "invalid_adapter_name"),
        ("", "invalid_adapter_name"),
        ("x" * 65, "invalid_adapter_name"),
        (BASE, "adapter_name_reserved"),
    ],
)
async def test_bad_names_refused(
    env: TenancyEnv, registry_models: rf.RegistryModels, name: str, code: str
) -> None:
    token = env.tenant("acme")
    before = disk_state(env)
    r = await upload(env.http, token, name, registry_models.adapters["a"].files())
    assert (r.status_code, r.json()["error"]["code"]) == (400, code), r.text
    assert disk_state(env) == before and row_counts(env) == (0, 0)


async def test_streamed_upload_without_length_stops_at_the_limit(
    env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    token = env.tenant("acme")
    before = disk_state(env)
    boundary = "----loraplex-test"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="{WEIGHTS}"\r\n\r\n'
    ).encode()
    sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        yield head
        for _ in range(64):  # 4 MiB in all, unless the server stops reading first
            sent += 1
            yield bytes(64 * 1024)
        yield f"\r\n--{boundary}--\r\n".encode()

    headers = {**bearer(token), "Content-Type": f"multipart/form-data; boundary={boundary}"}
    r = await env.http.post("/v1/adapters", content=body(), headers=headers)
    assert (r.status_code, r.json()["error"]["code"]) == (413, "adapter_too_large"), r.text
    assert sent < 8, "the server must stop reading once the limit is passed"
    assert disk_state(env) == before and row_counts(env) == (0, 0)


async def test_content_length_over_the_limit_is_refused_up_front(env: TenancyEnv) -> None:
    token = env.tenant("acme")
    headers = {
        **bearer(token),
        "Content-Type": "multipart/form-data; boundary=x",
        "Content-Length": str(50 << 20),
    }
    r = await env.http.post("/v1/adapters", content=b"--x--\r\n", headers=headers)
    assert (r.status_code, r.json()["error"]["code"]) == (413, "adapter_too_large")


async def test_malformed_uploads(env: TenancyEnv, registry_models: rf.RegistryModels) -> None:
    token = env.tenant("acme")
    a = registry_models.adapters["a"]
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"json": {"name": "x"}}, 400, "invalid_content_type"),
        ({"data": {"name": "x"}, "files": {"f": ("notes.txt", b"x")}}, 400, "unexpected_file"),
        ({"data": {"name": "x"}, "files": {"f": (CONFIG, a.config)}}, 400, "missing_file"),
        ({"data": {"name": "x"}}, 400, "invalid_content_type"),  # urlencoded, no files
    ]
    for kwargs, status, code in cases:
        r = await env.http.post("/v1/adapters", headers=bearer(token), **kwargs)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (kwargs, r.text)
    r = await upload(env.http, token, None, a.files())
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_adapter_name")
    both = {**a.files(), "a.zip": make_zip(a.files())}
    r = await upload(env.http, token, "x", both)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "unexpected_file")
    assert row_counts(env) == (0, 0) and list((env.store.data_dir / "tmp").iterdir()) == []


async def test_adapter_limit_counts_names_not_versions(
    db_env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    env = db_env
    a, b = registry_models.adapters["a"], registry_models.adapters["b"]
    token = env.tenant("acme", quotas=tenants.Quotas(max_adapters=1))
    assert (await upload(env.http, token, "one", a.files())).status_code == 201
    before = disk_state(env)
    r = await upload(env.http, token, "two", b.files())
    assert (r.status_code, r.json()["error"]["code"]) == (409, "adapter_limit_reached")
    assert disk_state(env) == before and row_counts(env) == (1, 1)
    r = await upload(env.http, token, "one", b.files())  # a new version is not a new adapter
    assert r.status_code == 201 and r.json()["latest_version"] == 2


async def test_scopes_and_the_operator_routes(
    db_env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    env = db_env
    a = registry_models.adapters["a"]
    reader = env.tenant("acme", scopes=(SCOPE_INFERENCE,))
    r = await upload(env.http, reader, "bot", a.files())
    assert (r.status_code, r.json()["error"]["code"]) == (403, "insufficient_scope")
    assert (await env.http.get("/v1/adapters", headers=bearer(reader))).json()["data"] == []
    r = await env.http.get("/v1/adapters", headers=env.admin_headers)
    assert (r.status_code, r.json()["error"]["code"]) == (403, "tenant_key_required")

    r = await upload(
        env.http, ADMIN_TOKEN, "bot", a.files(), path="/admin/api/tenants/acme/adapters"
    )
    assert r.status_code == 201 and r.json()["owned_by"] == "acme", r.text
    r = await env.http.get("/v1/adapters/bot", headers=bearer(reader))
    assert r.json()["versions"][0]["id"] == "bot@1"
    r = await env.http.get("/admin/api/tenants/acme/adapters", headers=env.admin_headers)
    assert [c["id"] for c in r.json()["data"]] == ["bot"]
    r = await env.http.get("/admin/api/tenants/acme/adapters/bot@1", headers=env.admin_headers)
    assert r.json()["versions"][0]["status"] == "ready"
    r = await env.http.get("/admin/api/tenants/nobody/adapters", headers=env.admin_headers)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "tenant_not_found")
    r = await env.http.get("/admin/api/tenants/acme/adapters", headers=bearer(reader))
    assert r.status_code == 403
    r = await env.http.delete("/admin/api/tenants/acme/adapters/bot", headers=env.admin_headers)
    assert r.json()["deleted"] is True
    assert [(a, actor) for a, _, actor in audit_actions(env)] == [
        ("adapter.upload", "admin"),
        ("adapter.delete", "admin"),
    ]


async def test_engine_refusal_after_validation_leaves_nothing(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any, database_url: str | None
) -> None:
    """The engine is the last check: when it refuses (its rank limit is lower than it says) or
    is down, the version that was "validating" goes, with its files and its number."""
    a, r16 = registry_models.adapters["a"], registry_models.adapters["r16"]
    async with registry_env(
        tmp_path, registry_models, tokenizer, advertised_rank=64, database_url=database_url
    ) as env:
        token = env.tenant("acme")
        before = disk_state(env)
        r = await upload(env.http, token, "bot", r16.files())
        assert (r.status_code, r.json()["error"]["code"]) == (400, "rank_too_large"), r.text
        assert disk_state(env) == before and row_counts(env) == (0, 0)

        assert (await upload(env.http, token, "bot", a.files())).status_code == 201
        before = disk_state(env)
        r = await upload(env.http, token, "bot", r16.files())  # as version 2
        assert (r.status_code, r.json()["error"]["code"]) == (400, "rank_too_large")
        assert disk_state(env) == before and row_counts(env) == (1, 1)

        env.fake.alive = False
        r = await upload(env.http, token, "bot", registry_models.adapters["b"].files())
        assert (r.status_code, r.json()["error"]["code"]) == (503, "engine_unavailable")
        assert disk_state(env) == before and row_counts(env) == (1, 1)
        env.fake.alive = True
        r = await upload(env.http, token, "bot", registry_models.adapters["b"].files())
        assert r.json()["latest_version"] == 2  # the refused uploads' numbers were given back


async def test_deleting_a_tenant_removes_only_its_own_files(
    db_env: TenancyEnv, registry_models: rf.RegistryModels
) -> None:
    env = db_env
    a, b = registry_models.adapters["a"], registry_models.adapters["b"]
    engine = env.fake
    assert isinstance(engine, rf.RegistryEngine)
    acme, globex = env.tenant("acme"), env.tenant("globex")
    shared = (await upload(env.http, acme, "shared", a.files())).json()["versions"][0]
    assert (await upload(env.http, globex, "mine", a.files())).status_code == 201
    own = (await upload(env.http, acme, "own", b.files())).json()["versions"][0]
    r = await env.http.delete("/admin/api/tenants/acme", headers=env.admin_headers)
    assert r.status_code == 200, r.text
    stored = env.store.data_dir / "adapters"
    assert not (stored / own["content_sha256"]).exists()
    assert (stored / shared["content_sha256"]).is_dir()  # globex's "mine" names it
    assert engine.removed == [own["content_sha256"]]
    r = await env.http.post(
        "/v1/chat/completions",
        json={"model": "mine", "messages": [{"role": "user", "content": "t30"}], "max_tokens": 1},
        headers=bearer(globex),
    )
    assert r.status_code == 200 and engine.submitted[-1].lora_key == shared["content_sha256"]
