"""What a tenant reads when its adapter was trained on another shape: the geometry that does not
fit, never a filesystem path (neither the server's model directory nor the trainer's)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.utils import registry as rf
from tests.utils.registry import registry_env, upload

pytestmark = pytest.mark.anyio

registry_models = rf.registry_models


def _other_shape(adapter: rf.TinyAdapter, **config: Any) -> rf.TinyAdapter:
    """``adapter`` with q_proj's lora_A taking 32 features (the base model's q_proj takes 64)."""
    import torch

    tensors = adapter.tensors()
    name = next(n for n in sorted(tensors) if "q_proj.lora_A" in n)
    tensors[name] = torch.randn(tensors[name].shape[0], 32)
    return adapter.with_tensors(tensors).with_config(**config)


@pytest.mark.parametrize(
    "trained_on",
    [None, "/home/alice/checkpoints/llama-3-8b", "HuggingFaceTB/SmolLM2-135M-Instruct"],
    ids=["server-model-dir", "trainer-path", "hub-id"],
)
async def test_a_wrong_shape_names_the_geometry_not_a_path(
    tmp_path: Path, registry_models: rf.RegistryModels, tokenizer: Any, trained_on: str | None
) -> None:
    a = registry_models.adapters["a"]
    # PEFT records the directory it trained from: for "a" it is this server's model directory.
    changes = {} if trained_on is None else {"base_model_name_or_path": trained_on}
    bad = _other_shape(a, **changes)
    async with registry_env(tmp_path, registry_models, tokenizer) as env:
        r = await upload(env.http, env.tenant("acme"), "bot", bad.files())
    assert (r.status_code, r.json()["error"]["code"]) == (400, "base_model_mismatch"), r.text
    message = r.json()["error"]["message"]
    assert registry_models.model_dir not in message
    assert trained_on is None or trained_on not in message
    assert not re.search(r"(^|[\s'(])/\w", message), message  # no absolute path at all
    assert "LlamaForCausalLM with 2 layers, hidden size 64" in message
    assert "q_proj is 64 -> 64 in the base model, but the adapter has 32 -> 64" in message
