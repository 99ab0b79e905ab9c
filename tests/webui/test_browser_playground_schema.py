"""The Playground's JSON schema box in headless Chromium, with JavaScript on and off: a schema
that is not JSON is marked under the box (the streamed runs' 400 is shown where the page
without scripts shows it) and nothing runs; fixed, both columns answer, and the mark goes.
Uses a byte-level tokenizer, which can carry a grammar (the tiny model's word-level one cannot).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.utils import browser as base
from tests.utils import registry as rf
from tests.utils.app import add_chat_template
from tests.utils.registry import CONFIG, WEIGHTS
from tests.utils.registry_web import build_web, create_tenant
from tests.utils.server import ServerThread
from tests.utils.structured import write_byte_tokenizer
from tests.utils.web import ADMIN_TOKEN, WebEnv

pytestmark = base.needs_chromium
expect = base.expect
browser = base.browser
registry_models = rf.registry_models
__all__ = ["browser", "registry_models"]

SCHEMA = json.dumps({"type": "object", "properties": {"answer": {"type": "string"}}})


@pytest.fixture
def served(tmp_path: Path, registry_models: rf.RegistryModels) -> Iterator[tuple[WebEnv, str]]:
    from transformers import AutoTokenizer

    write_byte_tokenizer(tmp_path / "bytes")
    add_chat_template(tmp_path / "bytes")
    env = build_web(tmp_path, registry_models, AutoTokenizer.from_pretrained(tmp_path / "bytes"))
    create_tenant(env, "acme")
    try:
        with ServerThread(env.app) as server:
            yield env, server.url
    finally:
        env.close()


def _ready(page: Any, url: str, folder: Path, adapter: rf.TinyAdapter) -> None:
    """Sign in, upload acme/bot through the form, open acme's playground."""
    page.goto(url + "/admin/adapters/upload")
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(re.compile("/admin/adapters/upload$"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_bytes(adapter.config)
    (folder / WEIGHTS).write_bytes(adapter.weights)
    page.get_by_label("Tenant").select_option("acme")
    page.get_by_label("Adapter name").fill("bot")
    page.get_by_label("Adapter files").set_input_files(
        [str(folder / CONFIG), str(folder / WEIGHTS)]
    )
    page.get_by_role("button", name="Upload and validate").click()
    expect(page.get_by_text("Uploaded acme/bot@1: ready.")).to_be_visible()
    page.goto(url + "/admin/playground?tenant=acme")
    page.get_by_label("Max tokens").fill("4")
    page.get_by_label("Prompt").fill("Is it sunny?")


@pytest.mark.parametrize("scripts", [True, False])
def test_a_bad_schema_is_marked_under_the_box(
    browser: Any,
    served: tuple[WebEnv, str],
    registry_models: rf.RegistryModels,
    tmp_path: Path,
    scripts: bool,
) -> None:
    env, url = served
    context = browser.new_context(java_script_enabled=scripts, viewport=base.DESKTOP)
    page = context.new_page()
    _ready(page, url, tmp_path / "a", registry_models.adapters["a"])
    env.fake.submitted.clear()
    box = page.get_by_label("JSON schema (optional)")
    box.fill("{not json")
    page.get_by_role("button", name="Run").click()
    error = page.locator("#f-schema-help.field-error")
    expect(error).to_contain_text("The schema is not valid JSON")
    expect(box).to_have_attribute("aria-invalid", "true")
    assert env.fake.submitted == []

    page.get_by_label("JSON schema (optional)").fill(SCHEMA)
    page.get_by_role("button", name="Run").click()
    for side in ("base", "adapter"):
        expect(page.locator(f"[data-side={side}] [data-meta]")).to_contain_text("4 tokens")
    expect(page.locator("#f-schema-help")).not_to_have_class(re.compile("field-error"))
    assert [s.params.structured_outputs is not None for s in env.fake.submitted] == [True, True]
    context.close()
