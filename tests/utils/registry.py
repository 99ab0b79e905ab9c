"""Fixtures for the adapter registry's tests: a tiny real base model, real PEFT adapters built
from it once per session, a fake engine that validates and hashes adapters exactly as the real
one does, and helpers to upload and to check that nothing was left behind.

The fake engine of ``tests/utils/fakes.py`` keys adapters by the hash of their config file
and its model directory has no ``config.json``; ``RegistryEngine`` instead runs
``load_adapter`` against the tiny model (so its keys are the real content hashes) and enforces
``max_lora_rank`` as the engine does.
"""

from __future__ import annotations

import asyncio
import io
import json
import stat
import struct
import tarfile
import zipfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from loraplex.engine.client import AdapterInfo, EngineDeadError
from loraplex.platform.db.models import Adapter, AdapterVersion
from tests.utils.app import add_chat_template
from tests.utils.fakes import FakeEngineClient
from tests.utils.models import make_tiny_model
from tests.utils.tenancy import TenancyEnv, tenancy_env

MAX_LORA_RANK = 8
MAX_ADAPTER_BYTES = 96 * 1024  # the tiny adapters are 5-30 KB
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


# ---- a base model and adapters ---------------------------------------------------------------


@dataclass(frozen=True)
class TinyAdapter:
    """A PEFT adapter's two files, as bytes."""

    config: bytes
    weights: bytes

    def files(self) -> dict[str, bytes]:
        return {CONFIG: self.config, WEIGHTS: self.weights}

    def with_config(self, **changes: Any) -> TinyAdapter:
        cfg = json.loads(self.config)
        cfg.update(changes)
        return TinyAdapter(json.dumps(cfg).encode(), self.weights)

    def tensors(self) -> dict[str, Any]:
        from safetensors.torch import load

        return dict(load(self.weights))

    def with_tensors(self, tensors: dict[str, Any]) -> TinyAdapter:
        from safetensors.torch import save

        return TinyAdapter(self.config, save({k: v.contiguous() for k, v in tensors.items()}))


@dataclass(frozen=True)
class RegistryModels:
    model_dir: str  # a tiny llama with a tokenizer, a chat template and config.json
    adapters: dict[str, TinyAdapter]  # "a", "b": rank 4 on q/v; "r16": rank 16 (over the limit)


def _peft_adapter(model_dir: str, out: Path, rank: int, seed: int) -> TinyAdapter:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = get_peft_model(base, cfg)
    model.save_pretrained(out)
    return TinyAdapter((out / CONFIG).read_bytes(), (out / WEIGHTS).read_bytes())


_BUILT: list[RegistryModels] = []  # built once per test session, whichever module asks first


@pytest.fixture(scope="session")
def registry_models(tmp_path_factory: pytest.TempPathFactory) -> RegistryModels:
    """Test modules bind this fixture by assignment (``registry_models = ...``); each module's
    binding is its own session fixture, so the result is cached here to be built only once."""
    if not _BUILT:
        _BUILT.append(_build_models(tmp_path_factory.mktemp("registry-models")))
    return _BUILT[0]


def _build_models(root: Path) -> RegistryModels:
    model_dir = make_tiny_model(root / "tiny-chat", "llama", seed=5)
    add_chat_template(model_dir)
    adapters = {
        name: _peft_adapter(model_dir, root / name, rank, seed)
        for name, rank, seed in (("a", 4, 1), ("b", 4, 2), ("r16", 16, 3))
    }
    return RegistryModels(model_dir, adapters)


# ---- an engine that knows adapters as the real one does --------------------------------------


@dataclass
class RegistryEngine(FakeEngineClient):
    """``add_lora`` validates with ``load_adapter`` against the tiny model; keys are content
    hashes. ``add_lora_calls`` records (name, path) of every load; ``removed`` every unload."""

    add_lora_calls: list[tuple[str, str]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    load_delay: float = 0.0  # seconds add_lora takes (lets concurrent first uses overlap)
    advertised_rank: int = MAX_LORA_RANK  # info.max_lora_rank; add_lora enforces MAX_LORA_RANK

    def __post_init__(self) -> None:
        self.max_lora_rank = self.advertised_rank  # what EngineInfo tells the platform
        super().__post_init__()

    async def _load_lora(self, name: str, path: str, pinned: bool) -> AdapterInfo:
        from transformers import AutoConfig

        from loraplex.lora.adapter import BaseModelInfo, load_adapter

        self.add_lora_calls.append((name, path))
        await asyncio.sleep(self.load_delay)
        if not self.alive:
            raise EngineDeadError("the fake engine is dead")
        base = BaseModelInfo.from_hf_config(AutoConfig.from_pretrained(self.model_dir))
        adapter = load_adapter(path, base, max_rank=MAX_LORA_RANK, name=name)
        info = AdapterInfo.from_adapter(adapter)
        self.adapters[info.key] = info
        return info

    async def _unload_lora(self, key: str) -> None:
        if self.running_on.get(key):  # as the engine core does
            raise ValueError(f"adapter {key[:12]} is in use by {self.running_on[key]} request(s)")
        self.removed.append(key)
        self.adapters.pop(key, None)


# ---- the app ---------------------------------------------------------------------------------


@asynccontextmanager
async def registry_env(
    tmp_path: Path,
    models: RegistryModels,
    tokenizer: Any,
    *,
    load_delay: float = 0.0,
    advertised_rank: int = MAX_LORA_RANK,
    **settings: Any,
) -> AsyncIterator[TenancyEnv]:
    """A multi-tenant app whose engine validates adapters against the tiny model; ``settings``
    are ``TenancySettings`` fields (``database_url=`` for PostgreSQL)."""
    settings.setdefault("max_adapter_bytes", MAX_ADAPTER_BYTES)
    engine = RegistryEngine(
        model_dir=models.model_dir, load_delay=load_delay, advertised_rank=advertised_rank
    )
    async with tenancy_env(tmp_path, engine, tokenizer, **settings) as env:
        yield env


# ---- uploads ---------------------------------------------------------------------------------


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def upload(
    http: httpx.AsyncClient,
    token: str,
    name: str | None,
    files: dict[str, bytes],
    *,
    path: str = "/v1/adapters",
    **fields: str,
) -> httpx.Response:
    """POST a multipart upload: ``files`` maps file names to contents."""
    data = dict(fields)
    if name is not None:
        data["name"] = name
    parts = [
        ("file", (fname, content, "application/octet-stream")) for fname, content in files.items()
    ]
    return await http.post(path, data=data, files=parts, headers=bearer(token))


def make_zip(members: dict[str, bytes], *, symlinks: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return buf.getvalue()


def make_tgz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def lying_header(weights: bytes) -> bytes:
    """The safetensors file with its first tensor's byte range claimed twice as long."""
    (n,) = struct.unpack("<Q", weights[:8])
    header = json.loads(weights[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, begin + 2 * (end - begin)]
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + weights[8 + n :]


# ---- nothing left behind ---------------------------------------------------------------------


def disk_state(env: TenancyEnv) -> set[str]:
    """Every file under the data directory except the database's own."""
    root = env.store.data_dir
    return {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if not p.is_dir() and not p.name.startswith("loraplex.db")
    }


def row_counts(env: TenancyEnv) -> tuple[int, int]:
    def count(session: Any) -> tuple[int, int]:
        adapters = session.scalar(select(func.count()).select_from(Adapter))
        versions = session.scalar(select(func.count()).select_from(AdapterVersion))
        return int(adapters or 0), int(versions or 0)

    return env.store.db.call(count)
