"""The admin UI on a multi-tenant app over the fake engine, with a fresh SQLite database.

``WebEnv.build(tmp_path)`` assembles ``create_app(FakeEngineClient, store=...)`` (the platform
with its admin UI); ``env.http()`` is an httpx client on it (no network); ``sign_in`` returns a
client holding a session; ``env.fake`` scripts the engine (``engine_stats``, ``alive``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loraplex.platform.settings import ServerSettings
from loraplex.platform.store import Store
from loraplex.server import LoraplexApp, create_app
from loraplex.webui import WebUI, WebUISettings
from tests.utils.fakes import FakeEngineClient
from tests.utils.tenancy import ADMIN_TOKEN, platform_for

__all__ = ["ADMIN_TOKEN", "WebEnv", "csrf_of", "post_form", "sign_in"]

_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_of(html: str) -> str:
    """The CSRF token of the first form on a page."""
    match = _CSRF.search(html)
    assert match, "no CSRF field on the page"
    return match.group(1)


@dataclass
class WebEnv:
    app: LoraplexApp
    store: Store
    fake: FakeEngineClient
    webui: WebUI

    @classmethod
    def build(
        cls, tmp_path: Path, *, tenancy: dict[str, Any] | None = None, **webui_settings: Any
    ) -> WebEnv:
        """``tenancy``: TenancySettings overrides (``admin_token=None``: a generated token)."""
        store = platform_for(tmp_path, **(tenancy or {}))
        fake = FakeEngineClient(model_dir=str(tmp_path / "tiny-model"))
        fake.engine_stats.update(
            num_running=3,
            num_waiting=1,
            kv_blocks_used=16,
            kv_blocks_total=64,
            kv_cache_usage=0.25,
            prefix_cache_hit_rate=0.5,
            lora_resident_device=2,
            lora_resident_host=3,
            lora_registered=5,
        )
        settings = WebUISettings(**webui_settings)
        app = create_app(fake, ServerSettings(), store=store, webui_settings=settings)
        assert app.webui is not None
        return cls(app, store, fake, app.webui)

    def http(self, *, root_path: str = "", base_url: str = "http://test") -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.app, root_path=root_path)
        return httpx.AsyncClient(transport=transport, base_url=base_url)

    def tenant_key(self, name: str = "acme") -> str:
        """A fresh API key of tenant ``name`` (created when missing)."""
        from loraplex.platform import tenants

        with self.store.db.session() as session:
            tenant = tenants.get_tenant(session, name) or tenants.create_tenant(
                session, "admin", name, quotas=tenants.Quotas()
            )
            _, new = tenants.create_key(session, "admin", tenant)
        return new.token

    def close(self) -> None:
        self.store.db.dispose()


async def sign_in(
    http: httpx.AsyncClient, token: str = ADMIN_TOKEN, *, prefix: str = "", next_path: str = ""
) -> httpx.Response:
    """Open the sign-in form and submit ``token``; returns the POST's response (303 on success)."""
    form = await http.get(f"{prefix}/admin/login")
    assert form.status_code == 200, form.text
    data = {"csrf_token": csrf_of(form.text), "token": token}
    if next_path:
        data["next"] = next_path
    return await http.post(f"{prefix}/admin/login", data=data)


async def post_form(
    http: httpx.AsyncClient, form_page: str, action: str, data: dict[str, Any]
) -> httpx.Response:
    """Open ``form_page`` (a signed-in page with a form) and POST ``data`` with its CSRF token to
    ``action``; returns the POST's response."""
    page = await http.get(form_page)
    assert page.status_code == 200, (form_page, page.status_code, page.text[:500])
    return await http.post(action, data={"csrf_token": csrf_of(page.text), **data})
