"""The Adapters page shows a version whose engine load failed with the engine's reason and a
Retry button (a CSRF-guarded form); retrying forgets the failure in the engine, is audited, and
the page shows the version as served again. Uploading content whose load failed retries it too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from loraplex.platform.db.models import AuditEvent
from tests.utils import registry as rf
from tests.utils.registry import upload
from tests.utils.registry_web import build_web, registry_models, table_rows, web_tokenizer
from tests.utils.web import WebEnv, csrf_of, sign_in

pytestmark = pytest.mark.anyio
__all__ = ["registry_models", "web_tokenizer"]  # fixtures, bound here for pytest

REASON = "adapter 'acme/x@1' could not be loaded: its stored files are damaged (bad_safetensors)"


@pytest.fixture
def web(tmp_path: Path, registry_models: rf.RegistryModels, web_tokenizer: Any) -> Iterator[WebEnv]:
    env = build_web(tmp_path, registry_models, web_tokenizer)
    try:
        yield env
    finally:
        env.close()


async def _failed_version(web: WebEnv, models: rf.RegistryModels) -> str:
    """acme's x@1, uploaded, whose engine load then failed (scripted); its content hash."""
    async with web.http() as http:
        r = await upload(http, web.tenant_key("acme"), "x", models.adapters["a"].files())
    assert r.status_code == 201, r.text
    content = str(r.json()["versions"][0]["content_sha256"])
    web.fake.engine_stats["lora_failed"] = {content: REASON}
    return content


async def test_a_failed_version_shows_its_reason_and_a_retry_button(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    content = await _failed_version(web, registry_models)
    async with web.http() as http:
        assert (await sign_in(http)).status_code == 303
        page = await http.get("/admin/adapters")
        assert page.status_code == 200
        [row] = table_rows(page.text)
        assert "failed" in row["Resident"] and "stored files are damaged" in row["Resident"]
        assert "Retry" in row["Actions"]
        action = 'action="/admin/adapters/acme/x@1/retry"'
        assert action in page.text
        form = page.text[page.text.index(action) :]
        assert 'name="csrf_token"' in form[: form.index("</form>")]

        refused = await http.post("/admin/adapters/acme/x@1/retry", data={})
        assert refused.status_code == 403  # no CSRF token
        assert web.fake.retried == []

        r = await http.post(
            "/admin/adapters/acme/x@1/retry", data={"csrf_token": csrf_of(page.text)}
        )
        assert r.status_code == 303, r.text
        assert web.fake.retried == [content]
        page = await http.get(r.headers["location"])
        assert "is loaded again at its next request" in page.text
        [row] = table_rows(page.text)
        assert "failed" not in row["Resident"] and "Retry" not in row["Actions"]
    with web.store.db.session() as session:
        [event] = session.scalars(
            select(AuditEvent).where(AuditEvent.action == "adapter_version.retry")
        ).all()
        assert (event.actor, event.object_id, event.after) == (
            "admin (web)",
            "x@1",
            {"had_failed": True},
        )


async def test_uploading_failed_content_retries_it(
    web: WebEnv, registry_models: rf.RegistryModels
) -> None:
    content = await _failed_version(web, registry_models)
    assert web.fake.retried == []
    async with web.http() as http:
        r = await upload(http, web.tenant_key("acme"), "x", registry_models.adapters["a"].files())
        assert r.status_code == 201, r.text
        assert web.fake.retried == [content]  # before x@2 was made ready
        r = await upload(http, web.tenant_key("acme"), "y", registry_models.adapters["b"].files())
        assert r.status_code == 201, r.text
    assert web.fake.retried == [content]  # content that had not failed is not retried
