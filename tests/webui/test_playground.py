"""The Playground: the base model's and an adapter's answers side by side, without scripts (one
form POST) and streamed (two SSE POSTs); run as the operator for the tenant, recorded as the
operator's usage, and guarded like every form."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from loraplex.platform.db.models import Tenant, UsageRecord
from tests.utils import registry as rf
from tests.utils.asgi import drive_until_disconnect
from tests.utils.registry_web import (
    build_web,
    create_tenant,
    field_errors,
    registry_models,
    upload_through_form,
    web_tokenizer,
)
from tests.utils.web import WebEnv, csrf_of, sign_in

pytestmark = pytest.mark.anyio
__all__ = ["registry_models", "web_tokenizer"]  # fixtures, bound here for pytest

BASE = "tiny-chat"  # the tiny model's directory name: the base model's served name
ANSWER = "t10 t11 t12 t13 t14"  # the fake engine counts up from token 10


@pytest.fixture
def web(tmp_path: Path, registry_models: rf.RegistryModels, web_tokenizer: Any) -> Iterator[WebEnv]:
    env = build_web(tmp_path, registry_models, web_tokenizer)
    create_tenant(env, "acme")
    create_tenant(env, "beta")
    try:
        yield env
    finally:
        env.close()


async def signed_in_with_adapter(web: WebEnv, http: Any, models: rf.RegistryModels) -> str:
    """Sign in, upload adapter "a" as acme/bot; returns the playground page's CSRF token."""
    await sign_in(http)
    r = await upload_through_form(http, "acme", "bot", models.adapters["a"].files())
    assert r.status_code == 303, r.text[:400]
    page = await http.get("/admin/playground", params={"tenant": "acme"})
    assert page.status_code == 200
    return csrf_of(page.text)


def form(csrf: str, **fields: str) -> dict[str, str]:
    values = {
        "csrf_token": csrf, "tenant": "acme", "model": "bot", "prompt": "t30 t31",
        "max_tokens": "5", "temperature": "0",
    }  # fmt: skip
    values.update(fields)
    return values


def sse(text: str) -> list[tuple[str, Any]]:
    """(event name, data) of an SSE body ("message" for unnamed events)."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = "message", None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
        out.append((name, data))
    return out


async def usage_rows(web: WebEnv) -> list[tuple[int | None, str, str, int]]:
    recorder = web.app.platform.tenancy.usage
    await recorder.flush()

    def read(session: Any) -> list[tuple[int | None, str, str, int]]:
        rows = session.scalars(select(UsageRecord).order_by(UsageRecord.model))
        return [(r.tenant_id, r.model, r.endpoint, r.completion_tokens) for r in rows]

    return web.store.db.call(read)


async def test_the_page_lists_a_tenants_models(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    async with web.http() as http:
        await signed_in_with_adapter(web, http, registry_models)
        page = await http.get("/admin/playground", params={"tenant": "acme"})
        assert '<option value="bot" selected>bot (newest ready version)</option>' in page.text
        assert '<option value="bot@1">bot@1</option>' in page.text
        assert f'<option value="{BASE}">Base model only ({BASE})</option>' in page.text
        assert 'data-stream-src="/admin/playground/stream"' in page.text
        assert 'type="hidden" name="tenant" value="acme"' in page.text
        assert "data-answers hidden" in page.text  # nothing run yet
        # another tenant does not see acme's adapter; an unknown tenant is marked
        page = await http.get("/admin/playground", params={"tenant": "beta"})
        assert 'value="bot"' not in page.text and f'<option value="{BASE}"' in page.text
        page = await http.get("/admin/playground", params={"tenant": "ghost"})
        assert page.status_code == 404
        assert field_errors(page.text)["f-pick-tenant-help"] == "There is no tenant named 'ghost'."


async def test_without_scripts_the_form_shows_both_answers(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    async with web.http() as http:
        csrf = await signed_in_with_adapter(web, http, registry_models)
        web.fake.submitted.clear()
        page = await http.post("/admin/playground", data=form(csrf))
        assert page.status_code == 200, page.text[:500]
        assert "data-answers hidden" not in page.text
        base = page.text.split('data-side="base"', 1)[1].split("</section>", 1)[0]
        adapter = page.text.split('data-side="adapter"', 1)[1].split("</section>", 1)[0]
        for column, model in ((base, BASE), (adapter, "bot@1")):
            assert f'<code class="pg-model" data-model>{model}</code>' in column
            assert f'<div class="pg-text" data-text aria-live="off">{ANSWER}</div>' in column
            assert "5 tokens" in column and "stopped at max tokens" in column
        # what was typed stays in the form
        assert ">t30 t31</textarea>" in page.text and '<option value="bot" selected>' in page.text

    # one engine request per side: the adapter's by its content hash, both with acme's salt
    salt = web.store.db.call(
        lambda s: s.scalars(select(Tenant.cache_salt).where(Tenant.name == "acme")).one()
    )
    subs = sorted(web.fake.submitted, key=lambda s: s.lora_key or "")
    assert [s.lora_key is None for s in subs] == [True, False]
    assert subs[1].lora_key in web.fake.adapters
    assert all(s.cache_extra_keys == (f"salt:{salt}",) for s in subs)
    assert all(s.params.max_tokens == 5 and s.params.temperature == 0 for s in subs)
    # usage: the operator's (no tenant), named after the tenant and model, never acme's
    assert await usage_rows(web) == [
        (None, "playground:acme/bot@1", "/admin/playground", 5),
        (None, f"playground:acme/{BASE}", "/admin/playground", 5),
    ]


async def test_the_base_model_alone_is_one_column(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    async with web.http() as http:
        csrf = await signed_in_with_adapter(web, http, registry_models)
        page = await http.post("/admin/playground", data=form(csrf, model=BASE))
        assert page.status_code == 200
        assert page.text.count(ANSWER) == 1
        assert 'data-side="adapter" aria-labelledby="pg-adapter-title" hidden' in page.text


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"prompt": "   "}, "f-prompt-help", "Type a prompt"),
        ({"max_tokens": "257"}, "f-max_tokens-help", "from 1 to 256"),
        ({"max_tokens": "0"}, "f-max_tokens-help", "from 1 to 256"),
        ({"temperature": "nan"}, "f-temperature-help", "from 0 (greedy) to 2"),
        ({"temperature": "3"}, "f-temperature-help", "from 0 (greedy) to 2"),
        ({"tenant": "ghost"}, "f-pick-tenant-help", "no tenant named 'ghost'"),
    ],
)
async def test_bad_input_is_marked_inline(
    web: WebEnv, registry_models: rf.RegistryModels, fields: dict[str, str], field: str, words: str
) -> None:
    async with web.http() as http:
        csrf = await signed_in_with_adapter(web, http, registry_models)
        web.fake.submitted.clear()
        page = await http.post("/admin/playground", data=form(csrf, **fields))
        assert page.status_code in (400, 404)
        assert words in field_errors(page.text)[field]
        assert web.fake.submitted == []


async def test_problems_of_one_side_show_in_its_column(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    async with web.http() as http:
        csrf = await signed_in_with_adapter(web, http, registry_models)
        # beta has no adapter "bot": its column says so, the base model still answers
        page = await http.post("/admin/playground", data=form(csrf, tenant="beta"))
        assert page.status_code == 200
        adapter = page.text.split('data-side="adapter"', 1)[1].split("</section>", 1)[0]
        assert "does not exist or you do not have access to it" in adapter
        assert page.text.count(ANSWER) == 1
        # a prompt longer than the context
        page = await http.post("/admin/playground", data=form(csrf, prompt="t7 " * 300))
        assert page.text.count("shorten the prompt") == 2
        # the engine is down
        web.fake.alive = False
        page = await http.post("/admin/playground", data=form(csrf))
        assert page.status_code == 200 and page.text.count("is not available") == 2


async def test_the_stream_sends_text_as_it_comes(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    async with web.http() as http:
        csrf = await signed_in_with_adapter(web, http, registry_models)
        for side, model in (("adapter", "bot@1"), ("base", BASE)):
            r = await http.post("/admin/playground/stream", data={**form(csrf), "side": side})
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert r.headers["cache-control"] == "no-store"
            events = sse(r.text)
            assert events[0] == ("start", {"model": model, "side": side, "max_tokens": 5})
            texts = [data["text"] for name, data in events if name == "message"]
            assert len(texts) >= 2 and "".join(texts) == ANSWER  # several deltas, in order
            name, done = events[-1]
            assert name == "done" and done["finish_reason"] == "length"
            assert done["completion_tokens"] == 5
    assert [m for _, m, _, _ in await usage_rows(web)] == [
        "playground:acme/bot@1", f"playground:acme/{BASE}",
    ]  # fmt: skip


async def test_the_stream_refuses_without_a_session_or_csrf(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    async with web.http() as http:
        csrf = await signed_in_with_adapter(web, http, registry_models)
        web.fake.submitted.clear()
        for token in ("", "forged"):
            r = await http.post("/admin/playground/stream", data={**form(token), "side": "base"})
            assert r.status_code == 403 and "This form was refused" in r.text
        r = await http.post(  # not a form: no token to find
            "/admin/playground/stream", content=b"{}", headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 403
        # problems before the first event are JSON errors the script shows
        r = await http.post("/admin/playground/stream", data={**form(csrf), "side": "left"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "side"
        r = await http.post(
            "/admin/playground/stream", data={**form(csrf, model=BASE), "side": "adapter"}
        )
        assert r.status_code == 400  # no adapter chosen: no adapter side
        r = await http.post(
            "/admin/playground/stream", data={**form(csrf, tenant="beta"), "side": "adapter"}
        )
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
        r = await http.post(
            "/admin/playground/stream", data={**form(csrf, max_tokens="999"), "side": "base"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    async with web.http() as stranger:
        r = await stranger.post("/admin/playground/stream", data={**form(csrf), "side": "base"})
        assert r.status_code == 403 and "Sign in" in r.text
    assert web.fake.submitted == []


async def test_an_engine_failure_mid_stream_is_an_error_event(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    async with web.http() as http:
        csrf = await signed_in_with_adapter(web, http, registry_models)
        web.fake.die_after = 2
        r = await http.post("/admin/playground/stream", data={**form(csrf), "side": "adapter"})
        events = sse(r.text)
        assert events[0][0] == "start"
        name, data = events[-1]
        assert name == "error" and "is not available" in data["message"]
    assert [(m, n) for _, m, _, n in await usage_rows(web)] == [("playground:acme/bot@1", 2)]


async def test_a_browser_leaving_a_stream_aborts_the_run_and_is_accounted(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    """The playground streams through the API's SSE response: a browser that goes away stops
    the engine request at once, and the run is recorded as the API records a request (tokens
    produced so far, status 499)."""
    from urllib.parse import urlencode

    async with web.http() as http:
        csrf = await signed_in_with_adapter(web, http, registry_models)
        cookies = "; ".join(f"{k}={v}" for k, v in http.cookies.items())
    web.fake.step_delay = 0.02
    body = urlencode({**form(csrf, max_tokens="200"), "side": "base"}).encode()
    sent = await drive_until_disconnect(
        web.app,
        "/admin/playground/stream",
        body,
        lambda sent: sum(1 for m in sent if m.get("body")) >= 4,  # start + a few deltas
        extra_headers=((b"cookie", cookies.encode()),),
        content_type=b"application/x-www-form-urlencoded",
    )
    assert sent[0]["status"] == 200
    (run,) = web.fake.submitted
    assert web.fake.aborted == [run.request_id] and web.fake.finished == []
    (row,) = [r for r in await usage_rows(web) if r[1] == f"playground:acme/{BASE}"]
    assert 0 < row[3] < 200  # the tokens produced before the browser left
