"""Uploads cannot exhaust the API process's memory: refused uploads leave its resident memory
where it was (a real server, measured from /proc), and concurrent uploads beyond
``max_concurrent_uploads`` are answered 429 before their bodies are read, their slots given
back however an upload ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest

from loraplex.platform.settings import TenancySettings
from tests.utils import registry as rf
from tests.utils.app import add_chat_template
from tests.utils.models import make_tiny_model
from tests.utils.registry import CONFIG, WEIGHTS, bearer, registry_env, upload
from tests.utils.tenancy import TenancyEnv
from tests.utils.web import csrf_of, sign_in

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "upload_memory.py"
registry_models = rf.registry_models


# ---- a real server's resident memory -----------------------------------------------------------


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Wide enough that a valid rank-64 adapter of every module is 11 MiB (the NaN upload)."""
    model_dir = make_tiny_model(
        tmp_path_factory.mktemp("memory") / "wide", "llama", seed=1, hidden_size=256,
        intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    add_chat_template(model_dir)
    return model_dir


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/<pid>/status")
def test_concurrent_refused_uploads_leave_resident_memory_flat(wide_model: str) -> None:
    """``benchmarks/upload_memory.py``: a real server, three concurrent 48 MiB uploads (wrong
    shapes, a lying header: both refused from the header; NaN weights: refused after every
    byte was read). Reading uploads whole grew the server by their sum and kept it."""
    size_mb = 48
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", wide_model, "--size-mb", str(size_mb)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["answers"] == [
        [400, "base_model_mismatch"],
        [400, "bad_safetensors"],
        [400, "nan_weights"],
    ], result
    assert result["upload_mb"][:2] == [size_mb, size_mb] and result["upload_mb"][2] > 10
    assert result["peak_growth_mb"] < size_mb / 3, result  # the uploads sum to 107 MiB
    assert result["growth_mb"] < size_mb / 3, result


# ---- the concurrency limit ---------------------------------------------------------------------


def test_the_limit_is_a_bounded_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TenancySettings().max_concurrent_uploads == 2
    monkeypatch.setenv("LORAPLEX_MAX_CONCURRENT_UPLOADS", "5")
    assert TenancySettings().max_concurrent_uploads == 5
    monkeypatch.setenv("LORAPLEX_MAX_CONCURRENT_UPLOADS", "0")
    with pytest.raises(pydantic.ValidationError):
        TenancySettings()


BOUNDARY = "limit-test-boundary"


def _stalled_body(adapter: rf.TinyAdapter, name: str, go: asyncio.Event) -> AsyncIterator[bytes]:
    """A multipart upload that sends its head, then waits for ``go`` to send the rest."""

    async def body() -> AsyncIterator[bytes]:
        yield (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="name"\r\n\r\n{name}\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{CONFIG}"\r\n\r\n'
        ).encode() + adapter.config
        await go.wait()
        yield (
            (
                f'\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
                f'filename="{WEIGHTS}"\r\n\r\n'
            ).encode()
            + adapter.weights
            + f"\r\n--{BOUNDARY}--\r\n".encode()
        )

    return body()


async def _post_stalled(
    env: TenancyEnv, token: str, adapter: rf.TinyAdapter, name: str, go: asyncio.Event
) -> Any:
    headers = {**bearer(token), "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    body = _stalled_body(adapter, name, go)
    return await env.http.post("/v1/adapters", content=body, headers=headers)


async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.anyio
async def test_uploads_past_the_limit_get_429_and_slots_come_back(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    a = registry_models.adapters["a"]
    async with registry_env(tmp_path, registry_models, tokenizer, max_concurrent_uploads=1) as env:
        slots = env.app.platform.tenancy.registry.upload_slots
        token = env.tenant("acme")
        go = asyncio.Event()
        first = asyncio.create_task(_post_stalled(env, token, a, "first", go))
        await _until(lambda: slots.active == 1)

        r = await upload(env.http, token, "second", a.files())
        assert (r.status_code, r.json()["error"]["code"]) == (429, "too_many_uploads"), r.text
        assert r.headers["retry-after"] == "5"
        assert "LORAPLEX_MAX_CONCURRENT_UPLOADS" in r.json()["error"]["message"]

        go.set()
        assert (await first).status_code == 201
        assert slots.active == 0

        # A client that goes away mid-body gives its slot back, and leaves no file behind.
        stalled = asyncio.create_task(_post_stalled(env, token, a, "gone", asyncio.Event()))
        await _until(lambda: slots.active == 1)
        stalled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stalled
        assert slots.active == 0
        assert list((env.store.data_dir / "tmp").iterdir()) == []

        # So does a refused upload.
        r = await upload(env.http, token, "bad", {CONFIG: a.config})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "missing_file")
        assert slots.active == 0
        r = await upload(env.http, token, "second", a.files())
        assert r.status_code == 201, r.text


@pytest.mark.anyio
async def test_the_admin_ui_upload_takes_a_slot_too(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    a = registry_models.adapters["a"]
    async with registry_env(tmp_path, registry_models, tokenizer, max_concurrent_uploads=1) as env:
        env.tenant("acme")
        assert (await sign_in(env.http)).status_code == 303
        page = await env.http.get("/admin/adapters/upload")
        assert page.status_code == 200, page.text[:300]
        data = {"csrf_token": csrf_of(page.text), "tenant": "acme", "name": "web"}
        files = [("file", (n, c, "application/octet-stream")) for n, c in a.files().items()]
        slots = env.app.platform.tenancy.registry.upload_slots
        with slots.hold():  # another upload is in flight
            r = await env.http.post("/admin/adapters/upload", data=data, files=files)
            assert r.status_code == 429 and "LORAPLEX_MAX_CONCURRENT_UPLOADS" in r.text
            api = await upload(env.http, env.tenant("acme"), "api", a.files())
            assert api.status_code == 429
        assert slots.active == 0
        page = await env.http.get("/admin/adapters/upload")
        data["csrf_token"] = csrf_of(page.text)
        r = await env.http.post("/admin/adapters/upload", data=data, files=files)
        assert r.status_code == 303, r.text[:300]
