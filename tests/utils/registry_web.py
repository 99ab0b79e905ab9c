"""The admin UI over an engine that validates adapters as the real one does (the registry's test
engine, ``tests/utils/registry.py``), with the tiny model's tokenizer, so uploads,
residency and the playground run for real; shared by the adapters, usage and playground tests.

``build_web(tmp_path, models, tokenizer)`` returns a ``WebEnv`` (its ``fake`` is the
``RegistryEngine``); ``upload_through_form`` posts the upload form as a browser does (the CSRF
token first, then the text fields, then the files).
"""

from __future__ import annotations

import re
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.platform import access
from loraplex.platform.settings import ServerSettings
from loraplex.server import create_app
from loraplex.webui import PAGES, SESSION_GUARDS
from loraplex.webui import adapters as adapters_page
from loraplex.webui import playground as playground_page
from loraplex.webui import usage as usage_page
from loraplex.webui.context import WebUI
from tests.utils import registry as rf
from tests.utils.registry import MAX_ADAPTER_BYTES, RegistryEngine, RegistryModels
from tests.utils.tenancy import platform_for
from tests.utils.web import WebEnv, csrf_of

MY_PAGES = (adapters_page, usage_page, playground_page)

# Fixtures for the test modules to import: the tiny model and its adapters (built once per
# session) and its tokenizer.
registry_models = rf.registry_models


@pytest.fixture(scope="session")
def web_tokenizer(registry_models: RegistryModels) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(registry_models.model_dir)


def mount_pages(app: Any, webui: WebUI) -> None:
    """Mount this suite's pages (and their navigation) where ``webui.PAGES`` lacks them."""
    for page in MY_PAGES:
        if page in PAGES:
            continue
        access.mount(app, page.router, "admin_ui", session_guards=SESSION_GUARDS)
        if page.NAV not in webui.nav:
            webui.nav.append(page.NAV)


def build_web(tmp_path: Path, models: RegistryModels, tokenizer: Any, **tenancy: Any) -> WebEnv:
    tenancy.setdefault("max_adapter_bytes", MAX_ADAPTER_BYTES)
    store = platform_for(tmp_path, **tenancy)
    engine = RegistryEngine(model_dir=models.model_dir, max_model_len=256)
    engine.engine_stats.update(
        lora_resident_device=1, lora_resident_host=2, lora_registered=3, num_running=0
    )
    app = create_app(engine, ServerSettings(), tokenizer=tokenizer, store=store)
    assert app.webui is not None
    mount_pages(app, app.webui)
    return WebEnv(app, store, engine, app.webui)


def create_tenant(env: WebEnv, name: str) -> int:
    from loraplex.platform import tenants

    with env.store.db.session() as session:
        tenant = tenants.get_tenant(session, name) or tenants.create_tenant(
            session, "admin", name, quotas=tenants.Quotas()
        )
        return tenant.id


async def upload_through_form(
    http: httpx.AsyncClient,
    tenant: str,
    name: str,
    files: dict[str, bytes],
    *,
    description: str = "",
    csrf: str | None = None,
) -> httpx.Response:
    """POST the upload form (``csrf`` None: the token of the form page)."""
    if csrf is None:
        page = await http.get("/admin/adapters/upload")
        assert page.status_code == 200, page.text[:300]
        csrf = csrf_of(page.text)
    data = {"csrf_token": csrf, "tenant": tenant, "name": name, "description": description}
    parts = [
        ("file", (fname, content, "application/octet-stream")) for fname, content in files.items()
    ]
    return await http.post("/admin/adapters/upload", data=data, files=parts)


class _Tables(HTMLParser):
    """Rows of the pages' tables: each ``<td data-label=...>``'s text, by label."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self._label: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr":
            self.rows.append({})
        elif tag == "td":
            self._label, self._text = dict(attrs).get("data-label") or "", []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._label is not None:
            self.rows[-1][self._label] = " ".join("".join(self._text).split())
            self._label = None

    def handle_data(self, data: str) -> None:
        if self._label is not None:
            self._text.append(data)


def table_rows(html: str) -> list[dict[str, str]]:
    parser = _Tables()
    parser.feed(html)
    return [row for row in parser.rows if row]


_FIELD_ERROR = re.compile(r'<p class="field-error" id="([^"]+)">([^<]*)</p>')


def field_errors(html: str) -> dict[str, str]:
    """Inline field errors of a page: the id of the message's element -> its text."""
    return {m.group(1): unescape(m.group(2)) for m in _FIELD_ERROR.finditer(html)}
