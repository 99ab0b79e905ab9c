"""The Adapters pages: upload through the form (a real PEFT adapter, validated as the engine
does), refused uploads shown inline with nothing stored, residency, filters, delete a version."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from sqlalchemy import select

from loraplex.platform.db.models import AdapterVersion, AuditEvent
from loraplex.webui import adapters as adapters_page
from tests.utils import registry as rf
from tests.utils.registry import CONFIG, WEIGHTS, make_zip, row_counts
from tests.utils.registry_web import (
    build_web,
    create_tenant,
    field_errors,
    registry_models,
    table_rows,
    upload_through_form,
    web_tokenizer,
)
from tests.utils.web import WebEnv, csrf_of, sign_in

pytestmark = pytest.mark.anyio
__all__ = ["registry_models", "web_tokenizer"]  # fixtures, bound here for pytest


@pytest.fixture
def web(tmp_path: Path, registry_models: rf.RegistryModels, web_tokenizer: Any) -> Iterator[WebEnv]:
    env = build_web(tmp_path, registry_models, web_tokenizer)
    create_tenant(env, "acme")
    try:
        yield env
    finally:
        env.close()


def versions(env: WebEnv) -> list[tuple[str, int, str]]:
    def read(session: Any) -> list[tuple[str, int, str]]:
        rows = session.scalars(select(AdapterVersion).order_by(AdapterVersion.id))
        return [(v.adapter.name, v.number, v.status) for v in rows]

    return env.store.db.call(read)


def hashes(env: WebEnv) -> dict[str, str]:
    """Adapter name -> content hash of its newest version."""

    def read(session: Any) -> dict[str, str]:
        rows = session.scalars(select(AdapterVersion).order_by(AdapterVersion.number))
        return {v.adapter.name: v.content_sha256 for v in rows}

    return env.store.db.call(read)


def tmp_entries(env: WebEnv) -> list[Path]:
    return list((env.store.data_dir / "tmp").iterdir())


def stored(env: WebEnv) -> list[Path]:
    return list((env.store.data_dir / "adapters").iterdir())


def wrong_shapes(adapter: rf.TinyAdapter) -> rf.TinyAdapter:
    import torch

    tensors = adapter.tensors()
    name = next(n for n in sorted(tensors) if "q_proj.lora_A" in n)
    tensors[name] = torch.randn(tensors[name].shape[0], 32)  # q_proj takes 64 features
    return adapter.with_tensors(tensors)


async def test_upload_through_the_form_makes_a_ready_version(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    a = registry_models.adapters["a"]
    async with web.http() as http:
        await sign_in(http)
        form = await http.get("/admin/adapters/upload", params={"tenant": "acme"})
        assert form.status_code == 200
        assert 'enctype="multipart/form-data"' in form.text
        assert '<option value="acme" selected>acme</option>' in form.text  # the tenant picker
        # the CSRF token is the form's first field (the server checks it before the files)
        body = form.text[form.text.index('action="/admin/adapters/upload"') :]
        assert body.index('name="csrf_token"') == body.index('name="')

        r = await upload_through_form(
            http, "acme", "support-bot", a.files(), description="<script>alert(1)</script>"
        )
        assert r.status_code == 303, r.text
        target = urlsplit(r.headers["location"])
        assert target.netloc == "" and target.path == "/admin/adapters"
        assert parse_qs(target.query) == {"tenant": ["acme"], "new": ["support-bot@1"]}

        page = await http.get(r.headers["location"])
        assert page.status_code == 200
        assert "Uploaded acme/support-bot@1: ready." in page.text
        assert "<script>alert(1)</script>" not in page.text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        (row,) = table_rows(page.text)
        assert row["Version"].startswith("support-bot@1 new")
        assert row["Status"] == "ready"
        assert row["Rank"] == "4 (α 8)"
        assert row["Target modules"] == "q_proj, v_proj"
        content_hash = hashes(web)["support-bot"]
        assert row["Content hash"] == content_hash[:12] + "…"
        assert f'title="sha256:{content_hash}"' in page.text
        assert row["Resident"] == "registered"  # the engine reports counts only
        assert "KiB" in row["Size"]
        assert row["Actions"] == "TryDelete…"  # two links
        try_it = '/admin/playground?tenant=acme&amp;model=support-bot%401"'
        assert try_it in page.text
        page = await http.get("/admin/playground?tenant=acme&model=support-bot%401")
        assert '<option value="support-bot@1" selected>' in page.text

    assert versions(web) == [("support-bot", 1, "ready")]
    assert tmp_entries(web) == []
    events = web.store.db.call(
        lambda s: [(e.action, e.actor, e.tenant_name) for e in s.scalars(select(AuditEvent))]
    )
    assert ("adapter.upload", "admin (web)", "acme") in events


async def test_an_archive_and_a_second_version(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    a, b = registry_models.adapters["a"], registry_models.adapters["b"]
    archive = make_zip({f"bot/{name}": data for name, data in b.files().items()})
    async with web.http() as http:
        await sign_in(http)
        assert (await upload_through_form(http, "acme", "bot", a.files())).status_code == 303
        r = await upload_through_form(http, "acme", "bot", {"bot.zip": archive})
        assert r.status_code == 303, r.text
        assert "new=bot%402" in r.headers["location"]
        rows = table_rows((await http.get("/admin/adapters?tenant=acme")).text)
        assert [r["Version"].split()[0] for r in rows] == ["bot@2", "bot@1"]  # newest first
    assert versions(web) == [("bot", 1, "ready"), ("bot", 2, "ready")]


BAD_UPLOADS = [
    ("pickle", 400, "pickle-format checkpoint"),
    ("wrong_shapes", 400, "q_proj"),
    ("rank_over_limit", 400, "rank"),
    ("oversized", 413, "larger than this server accepts"),
    ("no_files", 400, "holds no adapter file"),
]


def _bad_files(case: str, models: rf.RegistryModels) -> dict[str, bytes]:
    a = models.adapters["a"]
    if case == "pickle":
        return {CONFIG: a.config, "adapter_model.bin": b"\x80\x04\x95" + b"\x00" * 64}
    if case == "wrong_shapes":
        return wrong_shapes(a).files()
    if case == "rank_over_limit":
        return models.adapters["r16"].files()
    if case == "oversized":
        return {CONFIG: a.config, WEIGHTS: bytes(rf.MAX_ADAPTER_BYTES + 4096)}
    if case == "no_files":
        return {"": b""}  # a file input left empty
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "status", "words"), BAD_UPLOADS, ids=[c for c, _, _ in BAD_UPLOADS]
)
async def test_a_refused_upload_is_shown_inline_and_stores_nothing(
    web: WebEnv, registry_models: rf.RegistryModels, case: str, status: int, words: str
) -> None:
    async with web.http() as http:
        await sign_in(http)
        r = await upload_through_form(
            http, "acme", "victim", _bad_files(case, registry_models), description="kept"
        )
        assert r.status_code == status, r.text[:500]
        assert "text/html" in r.headers["content-type"]
        assert "The adapter was not uploaded and nothing was stored." in r.text
        errors = field_errors(r.text)
        assert words in errors["f-file-error"], errors
        # what was typed comes back; the files must be chosen again (browsers never refill them)
        assert 'name="name" type="text" value="victim"' in r.text and ">kept</textarea>" in r.text
        assert 'value="acme"' in r.text
        csrf_of(r.text)  # the form is there again, ready to resubmit
    assert row_counts(web) == (0, 0)  # type: ignore[arg-type]
    assert tmp_entries(web) == [] and stored(web) == []


async def test_field_errors_go_to_their_fields(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    files = registry_models.adapters["a"].files()
    async with web.http() as http:
        await sign_in(http)
        r = await upload_through_form(http, "nobody", "bot", files)
        assert r.status_code == 404
        assert "There is no tenant named 'nobody'" in field_errors(r.text)["f-tenant-help"]
        r = await upload_through_form(http, "acme", "bad name!", files)
        assert r.status_code == 400
        assert "Invalid adapter name" in field_errors(r.text)["f-name-help"]
        r = await upload_through_form(http, "acme", "tiny-chat", files)  # the base model's name
        assert r.status_code == 400
        assert "is the base model's name" in field_errors(r.text)["f-name-help"]
    assert row_counts(web) == (0, 0)  # type: ignore[arg-type]
    assert tmp_entries(web) == []


async def test_the_upload_checks_its_csrf_token_before_the_files(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    files = registry_models.adapters["a"].files()
    parts = [("file", (n, d, "application/octet-stream")) for n, d in files.items()]
    async with web.http() as http:
        await sign_in(http)
        token = csrf_of((await http.get("/admin/adapters/upload")).text)
        for data in (
            {"csrf_token": "forged", "tenant": "acme", "name": "bot"},
            {"tenant": "acme", "csrf_token": token, "name": "bot"},  # not the first field
            {"tenant": "acme", "name": "bot"},
        ):
            r = await http.post("/admin/adapters/upload", data=data, files=parts)
            assert r.status_code == 403, data
            assert "This form was refused" in r.text
        # a token sent as a file part does not count either
        r = await http.post(
            "/admin/adapters/upload",
            files=[("csrf_token", ("t.txt", token.encode(), "text/plain")), *parts],
        )
        assert r.status_code == 403
        # not multipart at all
        r = await http.post("/admin/adapters/upload", data={"csrf_token": token, "name": "bot"})
        assert r.status_code == 403
    async with web.http() as stranger:  # no session
        r = await upload_through_form(stranger, "acme", "bot", files, csrf=token)
        assert r.status_code == 403 and "Sign in" in r.text
    assert row_counts(web) == (0, 0)  # type: ignore[arg-type]
    assert tmp_entries(web) == []
    assert web.fake.add_lora_calls == []


async def test_residency_per_version(web: WebEnv, registry_models: rf.RegistryModels) -> None:
    async with web.http() as http:
        await sign_in(http)
        await upload_through_form(http, "acme", "hot", registry_models.adapters["a"].files())
        await upload_through_form(http, "acme", "cold", registry_models.adapters["b"].files())
        hot, cold = hashes(web)["hot"], hashes(web)["cold"]

        def resident(html: str) -> dict[str, str]:
            return {r["Version"].split()[0]: r["Resident"] for r in table_rows(html)}

        page = await http.get("/admin/adapters")
        assert resident(page.text) == {"cold@1": "registered", "hot@1": "registered"}
        assert "this engine reports counts only" in page.text

        web.fake.engine_stats["lora_residency"] = {hot: "device"}
        page = await http.get("/admin/adapters")
        assert resident(page.text) == {"cold@1": "disk", "hot@1": "device"}
        assert 'class="tier tier-device"' in page.text

        web.fake.engine_stats["lora_residency"] = {hot: "host", cold: "disk"}
        page = await http.get("/admin/adapters")
        assert resident(page.text) == {"cold@1": "disk", "hot@1": "host"}

        web.fake.alive = False
        page = await http.get("/admin/adapters")
        assert page.status_code == 200
        assert resident(page.text) == {"cold@1": "unknown", "hot@1": "unknown"}
        assert "The engine is not running." in page.text


async def test_the_tenant_filter_and_pages(
    web: WebEnv, registry_models: rf.RegistryModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_tenant(web, "beta")
    a = registry_models.adapters["a"]
    async with web.http() as http:
        await sign_in(http)
        for tenant, name in (("acme", "one"), ("acme", "two"), ("beta", "three")):
            assert (await upload_through_form(http, tenant, name, a.files())).status_code == 303
        rows = table_rows((await http.get("/admin/adapters")).text)
        assert [(r["Tenant"], r["Version"]) for r in rows] == [
            ("acme", "one@1"), ("acme", "two@1"), ("beta", "three@1"),
        ]  # fmt: skip
        rows = table_rows((await http.get("/admin/adapters", params={"tenant": "beta"})).text)
        assert [r["Version"] for r in rows] == ["three@1"] and "Tenant" not in rows[0]
        page = await http.get("/admin/adapters", params={"tenant": "ghost"})
        assert field_errors(page.text)["f-tenant-help"] == "There is no tenant named 'ghost'."
        assert table_rows(page.text) == []

        monkeypatch.setattr(adapters_page, "PAGE_SIZE", 2)
        page = await http.get("/admin/adapters", params={"page": "2"})
        assert [r["Version"] for r in table_rows(page.text)] == ["three@1"]
        assert "Page 2 of 2" in page.text and 'rel="prev"' in page.text
        page = await http.get("/admin/adapters", params={"page": "99"})  # past the end: the last
        assert "Page 2 of 2" in page.text


async def test_delete_a_version_after_confirming(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    a, b = registry_models.adapters["a"], registry_models.adapters["b"]
    async with web.http() as http:
        await sign_in(http)
        await upload_through_form(http, "acme", "bot", a.files())
        await upload_through_form(http, "acme", "bot", b.files())

        confirm = await http.get("/admin/adapters/acme/bot@1/delete")
        assert confirm.status_code == 200
        assert "Delete bot@1" in confirm.text and "only version" not in confirm.text
        r = await http.post(
            "/admin/adapters/acme/bot@1/delete", data={"csrf_token": csrf_of(confirm.text)}
        )
        assert r.status_code == 303 and r.headers["location"] == "/admin/adapters?tenant=acme"
        page = await http.get(r.headers["location"])
        assert "Deleted acme/bot@1." in page.text
        assert [r["Version"] for r in table_rows(page.text)] == ["bot@2"]
        assert versions(web) == [("bot", 2, "ready")]

        # the last version: the page says the adapter goes too
        confirm = await http.get("/admin/adapters/acme/bot@2/delete")
        assert "only version" in confirm.text
        r = await http.post(
            "/admin/adapters/acme/bot@2/delete", data={"csrf_token": csrf_of(confirm.text)}
        )
        assert r.status_code == 303
        assert versions(web) == [] and stored(web) == []

        # gone (or never there, or another tenant's): one "not found" page
        for path in ("/admin/adapters/acme/bot@2/delete", "/admin/adapters/ghost/bot@1/delete",
                     "/admin/adapters/acme/bot/delete", "/admin/adapters/acme/..@1/delete"):  # fmt: skip
            r = await http.get(path)
            assert r.status_code == 404, path
            assert "Not found" in r.text
        r = await http.post(
            "/admin/adapters/acme/bot@2/delete", data={"csrf_token": csrf_of(confirm.text)}
        )
        assert r.status_code == 404
    events = web.store.db.call(lambda s: [e.action for e in s.scalars(select(AuditEvent))])
    assert events.count("adapter_version.delete") == 1 and events.count("adapter.delete") == 1


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
async def test_the_leading_fields_are_read_from_any_chunking(chunk: int) -> None:
    """The CSRF token and the text fields before the files, however the body arrives; the bytes
    read are replayed, so the receiver sees the whole body."""
    request = httpx.Request(
        "POST",
        "http://test/admin/adapters/upload",
        data={"csrf_token": "tok", "tenant": "acme", "name": "bot"},
        files=[("file", ("adapter_config.json", b"{}" * 5000, "application/json"))],
    )
    body = request.read()
    boundary = request.headers["content-type"].split("boundary=", 1)[1].encode()

    async def stream() -> AsyncIterator[bytes]:
        for i in range(0, len(body), chunk):
            yield body[i : i + chunk]

    chunks = stream().__aiter__()
    fields, prefix = await adapters_page._read_leading_fields(chunks, boundary)
    assert fields == [("csrf_token", "tok"), ("tenant", "acme"), ("name", "bot")]
    assert len(prefix) <= adapters_page.CSRF_PART_LIMIT + chunk
    replayed = b"".join([c async for c in adapters_page._replayed(prefix, chunks)])
    assert replayed == body
