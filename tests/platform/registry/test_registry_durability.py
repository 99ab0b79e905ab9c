"""The registry survives a restart: a new app on the same data directory and database serves the
same names at the same versions, loading adapters into the (new) engine lazily, once."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from pathlib import Path
from typing import Any

import pytest

from loraplex.platform.db.models import AdapterVersion
from loraplex.platform.registry import service
from tests.utils import registry as rf
from tests.utils.registry import bearer, disk_state, registry_env, upload

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "t30"}], "max_tokens": 1}


async def test_names_and_versions_survive_a_restart(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any, database_url: str | None
) -> None:
    a, b = registry_models.adapters["a"], registry_models.adapters["b"]
    async with registry_env(
        tmp_path, registry_models, tokenizer, database_url=database_url
    ) as first:
        token = first.tenant("acme")
        await upload(first.http, token, "bot", a.files())
        r = await upload(first.http, token, "bot", b.files())
        keys = {v["id"]: v["content_sha256"] for v in r.json()["versions"]}
        await upload(first.http, token, "other", a.files())
        listing = (await first.http.get("/v1/adapters", headers=bearer(token))).json()
        files = disk_state(first)

    async with registry_env(
        tmp_path, registry_models, tokenizer, load_delay=0.05, database_url=database_url
    ) as second:
        engine = second.fake
        assert isinstance(engine, rf.RegistryEngine)
        assert engine.add_lora_calls == []  # nothing loaded until used
        assert (await second.http.get("/v1/adapters", headers=bearer(token))).json() == listing
        assert disk_state(second) == files
        h = bearer(token)
        # concurrent first uses of one version load it once
        responses = await asyncio.gather(
            *(
                second.http.post("/v1/chat/completions", json=_chat("bot"), headers=h)
                for _ in range(5)
            )
        )
        assert [r.status_code for r in responses] == [200] * 5
        assert {r.json()["model"] for r in responses} == {"bot@2"}
        assert len(engine.add_lora_calls) == 1
        assert {s.lora_key for s in engine.submitted} == {keys["bot@2"]}
        r = await second.http.post("/v1/chat/completions", json=_chat("bot@1"), headers=h)
        assert r.json()["model"] == "bot@1" and engine.submitted[-1].lora_key == keys["bot@1"]
        # "other" has bot@1's content: already in the engine, no second load
        r = await second.http.post("/v1/chat/completions", json=_chat("other"), headers=h)
        assert r.status_code == 200 and len(engine.add_lora_calls) == 2
        # numbering continues where it stopped
        r = await upload(second.http, token, "bot", a.files())
        assert r.json()["latest_version"] == 3


async def test_a_crash_mid_upload_is_cleaned_at_start(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any, database_url: str | None
) -> None:
    """A "validating" row and temp files left by a killed server go at the next start (once
    older than the upload timeout), and so do stored files no version names."""
    async with registry_env(
        tmp_path, registry_models, tokenizer, database_url=database_url
    ) as first:
        token = first.tenant("acme")
        await upload(first.http, token, "bot", registry_models.adapters["a"].files())

        def stall(session: Any) -> None:  # as if the engine load never finished
            version = session.query(AdapterVersion).one()
            version.status = "validating"
            version.created_at = version.created_at - dt.timedelta(
                seconds=service.STALE_UPLOAD_S + 1
            )

        first.store.db.call(stall)
        leftover = first.store.data_dir / "tmp" / "upload-crashed"
        leftover.mkdir()
        (leftover / "part").write_bytes(b"x")
        old = leftover.stat().st_mtime - service.STALE_UPLOAD_S - 1
        os.utime(leftover, (old, old))

    async with registry_env(
        tmp_path, registry_models, tokenizer, database_url=database_url
    ) as second:
        assert rf.row_counts(second) == (0, 0)
        assert disk_state(second) == set()
        r = await second.http.get("/v1/adapters", headers=bearer(token))
        assert r.json()["data"] == []
