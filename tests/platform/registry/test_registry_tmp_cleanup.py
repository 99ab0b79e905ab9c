"""A server killed mid-upload leaves its upload directory under ``tmp/``; the next start removes
it at once, however fresh (nothing can be uploading before the server takes requests), and
keeps what versions name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.utils import registry as rf
from tests.utils.registry import WEIGHTS, disk_state, registry_env, upload

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models


async def test_a_killed_uploads_fresh_leftovers_go_at_the_next_start(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    async with registry_env(tmp_path, registry_models, tokenizer) as first:
        token = first.tenant("acme")
        r = await upload(first.http, token, "bot", registry_models.adapters["a"].files())
        assert r.status_code == 201, r.text
        stored = disk_state(first)
        tmp = first.store.data_dir / "tmp"
        # What a SIGKILL in the middle of an upload leaves: its directory, seconds old.
        killed = tmp / "upload-0123456789abcdef"
        (killed / "received").mkdir(parents=True)
        (killed / "received" / WEIGHTS).write_bytes(b"\0" * 4096)
        (tmp / "removed-stray").write_bytes(b"x")

    async with registry_env(tmp_path, registry_models, tokenizer) as second:
        assert list((second.store.data_dir / "tmp").iterdir()) == []
        assert disk_state(second) == stored  # the stored version's files stay
        r = await second.http.get("/v1/adapters/bot", headers=rf.bearer(token))
        assert r.status_code == 200 and r.json()["latest_version"] == 1
