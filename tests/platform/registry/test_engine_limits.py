"""The engine tells its limits once (``EngineInfo``), and the registry checks uploads against
them: an adapter over the engine's rank, or on a module it does not serve, is refused before
the engine is asked to load it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.inproc_client import InprocEngineClient
from tests.utils import registry as rf
from tests.utils.registry import upload
from tests.utils.tenancy import tenancy_env

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models


def _config(model_dir: str, **lora: Any) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model_dir, max_model_len=128),
        cache=CacheConfig(block_size=4, num_blocks=64),
        lora=LoRAConfig(**lora),
    )


def test_engine_info_carries_the_engines_limits(registry_models: rf.RegistryModels) -> None:
    config = _config(registry_models.model_dir, max_loras=3, max_cpu_loras=5, max_lora_rank=12)
    _, info = EngineCore.build(config, registry_models.model_dir)
    assert (info.max_lora_rank, info.max_loras, info.max_cpu_loras) == (12, 3, 5)
    assert set(info.lora_target_modules) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip


async def test_uploads_are_checked_against_the_real_engines_rank(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    engine = InprocEngineClient(
        _config(registry_models.model_dir, max_lora_rank=2), registry_models.model_dir
    )
    await engine.start()
    asked: list[str] = []
    add_lora = engine.add_lora

    async def spied(name: str, path: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(name)
        return await add_lora(name, path, *args, **kwargs)

    engine.add_lora = spied  # type: ignore[method-assign]
    try:
        async with tenancy_env(tmp_path, engine, tokenizer) as env:
            token = env.tenant("acme")
            r = await upload(env.http, token, "x", registry_models.adapters["a"].files())  # rank 4
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "rank_too_large" and "maximum rank 2" in error["message"]
            assert asked == []  # refused before the engine was asked to load it
    finally:
        await engine.shutdown()


async def test_uploads_are_checked_against_the_engines_targets(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any
) -> None:
    async with rf.registry_env(tmp_path, registry_models, tokenizer) as env:
        engine = env.fake
        engine.info = dataclasses.replace(engine.info, lora_target_modules=("v_proj",))
        token = env.tenant("acme")
        r = await upload(env.http, token, "x", registry_models.adapters["a"].files())  # q, v
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "unsupported_target"
        assert "q_proj" in r.json()["error"]["message"]
        assert isinstance(engine, rf.RegistryEngine) and engine.add_lora_calls == []
