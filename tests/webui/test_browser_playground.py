"""The Adapters, Usage and Playground pages in headless Chromium: sign in, upload a real PEFT
adapter through the form and see it ready, see a refused upload's message inline, delete a
version, read usage and download its CSV, and run the playground: text streams into both
columns. Screenshots of each page at desktop and phone width go to ``screenshots/webui/``, each
checked for horizontal overflow (``shot``). A second test runs the playground with JavaScript
off: the form comes back with both answers.
"""

from __future__ import annotations

import datetime as dt
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from loraplex.platform.db.models import Tenant, UsageRecord, utcnow
from tests.utils import browser as base
from tests.utils import registry as rf
from tests.utils.registry import CONFIG, WEIGHTS
from tests.utils.registry_web import build_web, create_tenant, registry_models, web_tokenizer
from tests.utils.server import ServerThread
from tests.utils.web import ADMIN_TOKEN, WebEnv

pytestmark = base.needs_chromium
expect = base.expect
DESKTOP, PHONE = base.DESKTOP, base.PHONE

# The browser and the screenshot helper every browser test shares; the tiny model.
browser = base.browser
shot = base.shot
__all__ = ["browser", "registry_models", "shot", "web_tokenizer"]


@pytest.fixture
def served(
    tmp_path: Path, registry_models: rf.RegistryModels, web_tokenizer: Any
) -> Iterator[tuple[WebEnv, str]]:
    env = build_web(tmp_path, registry_models, web_tokenizer)
    env.fake.step_delay = 0.05  # tokens arrive one by one, as from a real engine
    for name in ("acme", "globex-industries", "initech"):
        create_tenant(env, name)
    seed_usage(env)
    try:
        with ServerThread(env.app) as server:
            yield env, server.url
    finally:
        env.close()


def seed_usage(env: WebEnv) -> None:
    """Two weeks of requests of three tenants, for the Usage page's charts."""
    rng = random.Random(3)
    today = utcnow().date()
    with env.store.db.session() as session:
        ids = dict(session.execute(select(Tenant.name, Tenant.id)).tuples().all())
        rows = []
        for back in range(14):
            day = dt.datetime.combine(
                today - dt.timedelta(days=back), dt.time(9), tzinfo=dt.timezone.utc
            )
            for tenant, model, load in (
                ("acme", "support-bot@1", 30), ("acme", "tiny-chat", 12),
                ("globex-industries", "summarizer@3", 20), ("initech", "tiny-chat", 6),
            ):  # fmt: skip
                for _ in range(rng.randint(load // 2, load)):
                    rows.append(
                        UsageRecord(
                            tenant_id=ids[tenant], model=model, endpoint="/v1/chat/completions",
                            prompt_tokens=rng.randint(40, 400), completion_tokens=rng.randint(20, 300),
                            status=500 if rng.random() < 0.03 else 200, created_at=day,
                        )
                    )  # fmt: skip
        session.add_all(rows)


def write_adapter(folder: Path, adapter: rf.TinyAdapter) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_bytes(adapter.config)
    (folder / WEIGHTS).write_bytes(adapter.weights)
    return [str(folder / CONFIG), str(folder / WEIGHTS)]


def collect_errors(page: Any) -> list[str]:
    errors: list[str] = []
    page.on(
        "console",
        lambda m: (
            errors.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.on("pageerror", lambda e: errors.append(str(e)))
    return errors


def sign_in(page: Any, url: str, path: str) -> None:
    page.goto(url + path)
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(re.compile(re.escape(path) + "$"))


def test_upload_see_it_ready_and_run_it_in_the_playground(
    browser: Any,
    served: tuple[WebEnv, str],
    shot: base.Shot,
    registry_models: rf.RegistryModels,
    tmp_path: Path,
) -> None:
    env, url = served
    page = browser.new_page(viewport=DESKTOP)
    errors = collect_errors(page)
    sign_in(page, url, "/admin/adapters")
    expect(page.get_by_role("heading", name="Adapters")).to_be_visible()
    expect(page.locator("p.empty")).to_contain_text("No adapters yet")

    # Upload through the form: the version is ready when the page comes back.
    page.get_by_role("link", name="Upload adapter").click()
    expect(page.get_by_role("heading", name="Upload an adapter")).to_be_visible()
    page.get_by_label("Tenant").select_option("acme")
    page.get_by_label("Adapter name").fill("support-bot")
    page.get_by_label("Description").fill("Answers support tickets in the house style.")
    page.get_by_label("Adapter files").set_input_files(
        write_adapter(tmp_path / "a", registry_models.adapters["a"])
    )
    shot(page, "adapters-upload")
    page.get_by_role("button", name="Upload and validate").click()
    expect(page).to_have_url(re.compile(r"/admin/adapters\?tenant=acme&new=support-bot%401$"))
    expect(page.get_by_text("Uploaded acme/support-bot@1: ready.")).to_be_visible()
    row = page.locator("tbody tr", has_text="support-bot@1")
    expect(row.locator(".badge", has_text="ready")).to_be_visible()
    expect(row.locator("td[data-label='Target modules']")).to_have_text("q_proj, v_proj")

    # A second version (as an archive-free pair again) and an adapter of another tenant.
    page.goto(url + "/admin/adapters/upload?tenant=acme")
    page.get_by_label("Adapter name").fill("support-bot")
    page.get_by_label("Adapter files").set_input_files(
        write_adapter(tmp_path / "b", registry_models.adapters["b"])
    )
    page.get_by_role("button", name="Upload and validate").click()
    expect(page.get_by_text("Uploaded acme/support-bot@2: ready.")).to_be_visible()

    # A refused upload: the registry's message inline, the typed values kept.
    page.goto(url + "/admin/adapters/upload?tenant=globex-industries")
    page.get_by_label("Adapter name").fill("too-big-rank")
    page.get_by_label("Adapter files").set_input_files(
        write_adapter(tmp_path / "r16", registry_models.adapters["r16"])
    )
    page.get_by_role("button", name="Upload and validate").click()
    expect(page.locator("#upload-error")).to_contain_text("nothing was stored")
    expect(page.locator("#f-file-error")).to_contain_text("rank")
    expect(page.get_by_label("Adapter name")).to_have_value("too-big-rank")
    shot(page, "adapters-upload-error")

    # The engine says where each adapter is (per adapter, when it reports that).
    hashes = list(env.fake.adapters)
    env.fake.engine_stats["lora_residency"] = {hashes[0]: "device", hashes[1]: "host"}
    page.goto(url + "/admin/adapters")
    expect(page.locator(".tier-device")).to_have_count(1)
    shot(page, "adapters")

    # Delete version 1 after the confirmation page.
    page.get_by_role("link", name="Delete acme/support-bot@1").click()
    expect(page.get_by_role("heading", name="Delete this version?")).to_be_visible()
    shot(page, "adapters-delete")
    page.get_by_role("button", name="Delete support-bot@1").click()
    expect(page.get_by_text("Deleted acme/support-bot@1.")).to_be_visible()
    expect(page.locator("tbody tr", has_text="support-bot@1")).to_have_count(0)

    # The playground: pick the tenant, its adapter, a prompt; text streams into both columns.
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Playground").click()
    expect(page.get_by_role("heading", name="Playground")).to_be_visible()
    page.get_by_label("Tenant").select_option("acme")
    page.get_by_role("button", name="Load adapters").click()
    page.get_by_label("Adapter to compare").select_option("support-bot")
    page.get_by_label("Max tokens").fill("40")
    page.get_by_label("Prompt").fill("t30 t31 t32")
    page.get_by_role("button", name="Run").click()
    base_text = page.locator("[data-side=base] [data-text]")
    adapter_text = page.locator("[data-side=adapter] [data-text]")
    expect(page.get_by_role("button", name="Running…")).to_be_disabled()
    expect(base_text).to_contain_text("t10 t11")
    expect(adapter_text).to_contain_text("t10 t11")
    # streamed: the columns show text before the last token arrived
    assert "t49" not in adapter_text.inner_text()
    expect(page.locator("[data-side=adapter] [data-model]")).to_have_text("support-bot@2")
    expect(page.locator("[data-side=base] [data-model]")).to_have_text("tiny-chat")
    for side in ("base", "adapter"):
        expect(page.locator(f"[data-side={side}] [data-meta]")).to_contain_text(
            "40 tokens", timeout=10_000
        )
    expect(adapter_text).to_contain_text("t49")
    expect(page.get_by_role("button", name="Run")).to_be_enabled()
    shot(page, "playground")

    # Stop ends both streams at once; the text that arrived stays.
    page.get_by_label("Max tokens").fill("200")
    page.get_by_role("button", name="Run").click()
    expect(adapter_text).to_contain_text("t12")
    page.get_by_role("button", name="Stop").click()
    for side in ("base", "adapter"):
        expect(page.locator(f"[data-side={side}] [data-meta]")).to_contain_text("Stopped after")
    expect(page.get_by_role("button", name="Run")).to_be_enabled()
    assert "t100" not in adapter_text.inner_text()
    for _ in range(40):  # the server saw the streams close and aborted both engine requests
        if len([r for r in env.fake.aborted if r.startswith("playground-")]) >= 2:
            break
        page.wait_for_timeout(50)
    assert len([r for r in env.fake.aborted if r.startswith("playground-")]) >= 2, env.fake.aborted

    # Usage: the playground's runs are the operator's; the CSV downloads.
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Usage").click()
    expect(page.get_by_role("heading", name="Usage")).to_be_visible()
    expect(page.locator(".chart svg")).to_have_count(2)
    playground_rows = page.locator("tbody tr", has_text="playground:acme/support-bot@2")
    expect(playground_rows).to_have_count(1)
    expect(playground_rows.locator("td[data-label='Tenant']")).to_have_text("(operator)")
    shot(page, "usage")
    with page.expect_download() as download:
        page.get_by_role("link", name="Download CSV").click()
    assert re.fullmatch(r"loraplex-usage_\d{4}-\d\d-\d\d_\d{4}-\d\d-\d\d\.csv",
                        download.value.suggested_filename)  # fmt: skip
    assert errors == [], errors


def test_the_playground_without_javascript(
    browser: Any, served: tuple[WebEnv, str], registry_models: rf.RegistryModels, tmp_path: Path
) -> None:
    _, url = served
    context = browser.new_context(java_script_enabled=False, viewport=PHONE)
    page = context.new_page()
    sign_in(page, url, "/admin/adapters/upload")
    page.get_by_label("Tenant").select_option("acme")
    page.get_by_label("Adapter name").fill("bot")
    page.get_by_label("Adapter files").set_input_files(
        write_adapter(tmp_path / "a", registry_models.adapters["a"])
    )
    page.get_by_role("button", name="Upload and validate").click()
    expect(page.get_by_text("Uploaded acme/bot@1: ready.")).to_be_visible()

    page.goto(url + "/admin/playground?tenant=acme")
    page.get_by_label("Max tokens").fill("8")
    page.get_by_label("Prompt").fill("t30 t31")
    page.get_by_role("button", name="Run").click()
    expect(page.locator("[data-side=base] [data-text]")).to_have_text(
        "t10 t11 t12 t13 t14 t15 t16 t17"
    )
    expect(page.locator("[data-side=adapter] [data-text]")).to_have_text(
        "t10 t11 t12 t13 t14 t15 t16 t17"
    )
    expect(page.locator("[data-side=adapter] [data-model]")).to_have_text("bot@1")
    expect(page.get_by_label("Prompt")).to_have_value("t30 t31")
    context.close()
