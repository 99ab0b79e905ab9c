"""Every number in adapter_config.json is range-checked before any arithmetic on it: a huge or
negative r, lora_alpha, rank_pattern / alpha_pattern value or layers_to_transform entry is a
``bad_config`` refusal naming the field and its range, never an OverflowError (a 500)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from loraplex.lora.adapter import (
    CONFIG_NAME,
    MAX_CONFIG_ALPHA,
    MAX_CONFIG_RANK,
    AdapterError,
    BaseModelInfo,
    check_adapter,
    load_adapter,
)

HUGE = 10**400  # valid JSON; float() of it overflows
HF = LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
)  # fmt: skip


@pytest.fixture(scope="module")
def base() -> BaseModelInfo:
    return BaseModelInfo.from_hf_config(HF)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bounds") / "good"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(HF, dtype=torch.float32)
    cfg = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(model, cfg).save_pretrained(str(out))
    return out


def _with(good: Path, tmp_path: Path, **changes: Any) -> Path:
    out = tmp_path / "a"
    shutil.copytree(good, out)
    cfg = json.loads((out / CONFIG_NAME).read_text())
    cfg.update(changes)
    (out / CONFIG_NAME).write_text(json.dumps(cfg))
    return out


CASES: dict[str, tuple[dict[str, Any], str]] = {
    "alpha-huge": ({"lora_alpha": HUGE}, f"lora_alpha must be a positive number of at most {MAX_CONFIG_ALPHA}"),
    "alpha-1e20": ({"lora_alpha": 10**20}, "lora_alpha must be a positive number of at most"),
    "alpha-float": ({"lora_alpha": 1e300}, "lora_alpha must be a positive number of at most"),
    "alpha-negative": ({"lora_alpha": -16}, "lora_alpha must be a positive number"),
    "alpha-pattern-huge": (
        {"alpha_pattern": {"v_proj": HUGE}}, "alpha_pattern['v_proj'] must be a positive number"
    ),
    "alpha-pattern-negative": (
        {"alpha_pattern": {"v_proj": -1}}, "alpha_pattern['v_proj'] must be a positive number"
    ),
    "r-huge": ({"r": HUGE}, f"r must be a positive integer of at most {MAX_CONFIG_RANK}"),
    # every module's rank from rank_pattern: r itself is only used in the default scaling
    "r-huge-patterned": (
        {"r": 10**20, "rank_pattern": {"q_proj": 8, "v_proj": 8}},
        "r must be a positive integer of at most",
    ),
    "r-negative": ({"r": -8}, "r must be a positive integer"),
    "rank-pattern-huge": (
        {"rank_pattern": {"q_proj": 10**20}}, "rank_pattern['q_proj'] must be a positive integer"
    ),
    "rank-pattern-negative": (
        {"rank_pattern": {"q_proj": -4}}, "rank_pattern['q_proj'] must be a positive integer"
    ),
    "layers-huge": ({"layers_to_transform": [0, 10**20]}, "each from 0 to 999999"),
    "layer-huge": ({"layers_to_transform": HUGE}, "each from 0 to 999999"),
    "layers-negative": ({"layers_to_transform": [-1, 1]}, "each from 0 to 999999"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("loader", [check_adapter, load_adapter], ids=["check", "load"])
def test_out_of_range_numbers_are_bad_config(
    tmp_path: Path, base: BaseModelInfo, good: Path, case: str, loader: Any
) -> None:
    changes, hint = CASES[case]
    with pytest.raises(AdapterError) as info:
        loader(_with(good, tmp_path, **changes), base, max_rank=16)
    assert info.value.code == "bad_config", str(info.value)
    assert hint in str(info.value)
    assert len(str(info.value)) < 400  # the value is quoted cut short


def test_the_bounds_themselves_are_accepted(
    tmp_path: Path, base: BaseModelInfo, good: Path
) -> None:
    at_max = _with(good, tmp_path, lora_alpha=MAX_CONFIG_ALPHA, alpha_pattern={"v_proj": 1e-3})
    adapter = check_adapter(at_max, base, max_rank=16)
    assert adapter.alpha == MAX_CONFIG_ALPHA and adapter.scalings[(0, "v_proj")] == 1e-3 / 8
    # a rank within the config's bound but above the server's is the server's refusal
    with pytest.raises(AdapterError) as info:
        check_adapter(_with(good, tmp_path / "r", r=MAX_CONFIG_RANK), base, max_rank=16)
    assert info.value.code == "rank_too_large"
