"""Adapters across platform replicas with no shared disk: an upload through one replica is
served by the other (its files written there from the database), a version made on either is
usable on both, and a deletion on one unloads the adapter from the other's engine and disk
through the change feed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from loraplex.platform.db.models import AdapterBlob, PlatformEvent
from tests.utils import registry as rf
from tests.utils.registry import RegistryEngine, upload
from tests.utils.replicas import open_replicas
from tests.utils.tenancy import TenancyEnv, bearer

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models


def _completion(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "t30 t31", "max_tokens": 2}


async def _serve(env: TenancyEnv, key: str, model: str) -> httpx.Response:
    return await env.http.post("/v1/completions", json=_completion(model), headers=bearer(key))


async def _eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for ``condition`` (checked every 20 ms; the replicas poll every 50 ms)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "the other replica never caught up"
        await asyncio.sleep(0.02)


def _count(env: TenancyEnv, model: type[Any]) -> int:
    return int(env.store.db.call(lambda s: s.scalar(select(func.count()).select_from(model))))


async def test_upload_on_one_replica_served_by_the_other_and_deletion_unloads_it_there(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any, shared_url: str
) -> None:
    async with AsyncExitStack() as stack:
        a, b = await open_replicas(
            stack, tmp_path, registry_models.model_dir, tokenizer, shared_url,
            client=lambda _: RegistryEngine(model_dir=registry_models.model_dir),
            max_adapter_bytes=rf.MAX_ADAPTER_BYTES,
        )  # fmt: skip
        engine_a, engine_b = a.fake, b.fake
        assert isinstance(engine_a, RegistryEngine) and isinstance(engine_b, RegistryEngine)
        token = a.tenant("acme")
        r = await upload(a.http, token, "pirate", registry_models.adapters["a"].files())
        assert r.status_code == 201, r.text
        v1 = r.json()["versions"][0]["content_sha256"]
        stored_b = b.store.data_dir / "adapters" / v1
        assert not stored_b.exists()  # no shared data directory

        r = await _serve(b, token, "pirate")
        assert r.status_code == 200, r.text
        assert engine_b.submitted[-1].lora_key == v1
        assert stored_b.is_dir() and v1 in engine_b.adapters  # written from the database
        assert {p.name for p in stored_b.iterdir()} == {rf.CONFIG, rf.WEIGHTS}
        assert not list((b.store.data_dir / "tmp").iterdir())  # the staging dir is gone

        # A new version uploaded on B is the newest on A too.
        r = await upload(b.http, token, "pirate", registry_models.adapters["b"].files())
        assert r.status_code == 201, r.text
        v2 = r.json()["versions"][-1]["content_sha256"]
        assert (await _serve(a, token, "pirate")).status_code == 200
        assert engine_a.submitted[-1].lora_key == v2
        assert (await _serve(a, token, "pirate@1")).status_code == 200
        assert engine_a.submitted[-1].lora_key == v1

        # Deleting version 1 on A unloads it on B (the feed), files and all; v2 stays.
        r = await a.http.delete("/v1/adapters/pirate@1", headers=bearer(token))
        assert r.status_code in (200, 204), r.text
        assert v1 not in engine_a.adapters
        await _eventually(lambda: v1 not in engine_b.adapters and not stored_b.exists())
        assert v1 in engine_b.removed
        assert (await _serve(b, token, "pirate@1")).status_code == 404
        assert (await _serve(b, token, "pirate")).status_code == 200
        assert engine_b.submitted[-1].lora_key == v2

        # Deleting the adapter on B unloads v2 on A; the database keeps no blobs of it.
        r = await b.http.delete("/v1/adapters/pirate", headers=bearer(token))
        assert r.status_code in (200, 204), r.text
        stored_a = a.store.data_dir / "adapters" / v2
        await _eventually(lambda: v2 not in engine_a.adapters and not stored_a.exists())
        assert _count(a, AdapterBlob) == 0 and _count(a, PlatformEvent) == 2
