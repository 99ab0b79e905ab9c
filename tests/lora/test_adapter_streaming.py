"""Adapters are read from disk tensor by tensor: ``check_adapter`` validates without keeping
weights (upload validation) and ``load_adapter`` shares its one pass; memory stays bounded and
the content hash is the one earlier releases computed from the whole file."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from loraplex.lora.adapter import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterError,
    BaseModelInfo,
    check_adapter,
    load_adapter,
)
from loraplex.lora.archive import SafetensorsFile

PREFIX = "base_model.model.model.layers"
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
FANS = {"q_proj": (64, 64), "v_proj": (64, 32), "down_proj": (128, 64)}  # the base's (in, out)
MiB = 1 << 20


def name(layer: int, module: str, which: str) -> str:
    parent = "self_attn" if module in ATTN else "mlp"
    return f"{PREFIX}.{layer}.{parent}.{module}.lora_{which}.weight"


@pytest.fixture(scope="module")
def base() -> BaseModelInfo:
    return BaseModelInfo.from_hf_config(
        LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
        )
    )  # fmt: skip


def _values(shape: list[int], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic without an RNG: the same bytes on every machine and torch version."""
    n = shape[0] * shape[1]
    steps = torch.arange(n, dtype=torch.float64) * 0.37 + seed
    return (steps % 1.9 - 0.95).reshape(shape).to(dtype)


def _write(out: Path, dtype: torch.dtype, config: dict[str, Any], ranks: dict[str, int]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(2):
        for i, (module, (fan_in, fan_out)) in enumerate(FANS.items()):
            r = ranks.get(module, config["r"])
            tensors[name(layer, module, "A")] = _values([r, fan_in], layer * 7 + i, dtype)
            tensors[name(layer, module, "B")] = _values([fan_out, r], layer * 7 + i + 3, dtype)
    save_file(tensors, str(out / WEIGHTS_NAME))
    (out / CONFIG_NAME).write_text(json.dumps(config))
    return out


PLAIN = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": list(FANS)}
PATTERNED = {
    **PLAIN, "r": 4, "lora_alpha": 8, "use_rslora": True, "rank_pattern": {"v_proj": 2},
    "alpha_pattern": {r"layers\.1\.self_attn\.q_proj": 32},
}  # fmt: skip
# Computed by the loader before it read tensors one at a time (it hashed the whole file's bytes):
# a stored adapter's content hash, the engine's key for it, must not change across releases.
GOLDEN = {
    "f32": "1d879c13aa66ac5bfe89289672bc8a93e183fe09982c315bfd0d1b9f8e22415c",
    "bf16": "6806939f70dda91d90d0fc98fcfd855875fcd0f94384a5df578093e10705c765",
    "f16": "dc8e61f6da9ff7875d0ec48a13aebd6ce236ef3413d8b3c24f9cdef7ba0afe34",
}
VARIANTS = {
    "f32": (torch.float32, PLAIN, {}),
    "bf16": (torch.bfloat16, PATTERNED, {"v_proj": 2}),
    "f16": (torch.float16, PLAIN, {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_content_hash_is_unchanged_and_shared(
    tmp_path: Path, base: BaseModelInfo, variant: str
) -> None:
    dtype, config, ranks = VARIANTS[variant]
    path = _write(tmp_path / variant, dtype, config, ranks)
    loaded = load_adapter(path, base, max_rank=16)
    checked = check_adapter(path, base, max_rank=16)
    assert loaded.content_hash == checked.content_hash == GOLDEN[variant]
    for field in ("rank", "alpha", "scaling", "target_modules", "size_bytes", "scalings"):
        assert getattr(checked, field) == getattr(loaded, field), field
    assert not hasattr(checked, "weights")
    for (layer, module), (a, b) in loaded.weights.items():  # read in chunks, converted exactly
        i = list(FANS).index(module)
        fan_in, fan_out = FANS[module]
        r = ranks.get(module, config["r"])
        assert torch.equal(a, _values([r, fan_in], layer * 7 + i, dtype).float())
        assert torch.equal(b, _values([fan_out, r], layer * 7 + i + 3, dtype).float())


def test_a_file_that_shrinks_while_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / WEIGHTS_NAME
    save_file({"x": torch.ones(4, 1024)}, str(path))
    with SafetensorsFile(path, max_bytes=1 << 20) as st:
        os.truncate(path, path.stat().st_size - 100)
        with pytest.raises(AdapterError) as info:
            for _ in st.chunks("x"):
                pass
    assert info.value.code == "bad_safetensors" and "changed while read" in str(info.value)


# ---- memory ------------------------------------------------------------------------------------

_BIG_RANK = 8192  # q_proj, v_proj and down_proj of 2 layers at this rank: 64 MiB of float32


def _write_big(out: Path, nan: bool) -> Path:
    """A valid-shape adapter of 64 MiB (zeros), written without building it in memory; ``nan``:
    its last stored value (the last tensor the loader reads) is NaN."""
    out.mkdir(parents=True, exist_ok=True)
    config = {**PLAIN, "r": _BIG_RANK, "lora_alpha": _BIG_RANK}
    (out / CONFIG_NAME).write_text(json.dumps(config))
    header: dict[str, Any] = {}
    offset = 0
    for layer in range(2):  # the loader's order: (layer, module name), A then B
        for module in sorted(FANS):
            fan_in, fan_out = FANS[module]
            for which, shape in (("A", [_BIG_RANK, fan_in]), ("B", [fan_out, _BIG_RANK])):
                size = 4 * math.prod(shape)
                header[name(layer, module, which)] = {
                    "dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]
                }  # fmt: skip
                offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with (out / WEIGHTS_NAME).open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)  # zeros
        if nan:
            f.seek(8 + len(blob) + offset - 4)
            f.write(struct.pack("<f", float("nan")))
    return out


_PEAK = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from loraplex.lora.adapter import AdapterError, BaseModelInfo, check_adapter, load_adapter

    def status(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    base = BaseModelInfo("LlamaForCausalLM", 2, 64, 128, 4, 2, 16)
    fn = {"check": check_adapter, "load": load_adapter}[sys.argv[1]]

    def call(path):
        try:
            return fn(path, base, max_rank=8192, max_bytes=1 << 30), None
        except AdapterError as e:
            return None, e.code

    call(sys.argv[3])  # a small adapter first: imports and lazy initialisation
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    held, code = call(sys.argv[2])
    print(json.dumps({"peak": status("VmHWM") - before, "code": code}))
    """
)


def _peak(kind: str, path: Path, small: Path) -> dict[str, Any]:
    """Run ``check_adapter`` or ``load_adapter`` on ``path`` in a fresh interpreter (after one
    call on the adapter ``small``): the growth of its peak resident memory, the refusal code."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, kind, str(path), str(small)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_memory_stays_bounded_while_every_byte_is_checked(tmp_path: Path) -> None:
    size = 64 * MiB
    small = _write(tmp_path / "small", torch.float32, PLAIN, {})
    nan = _write_big(tmp_path / "nan", nan=True)
    checked = _peak("check", nan, small)  # reads and checks all 64 MiB before the NaN
    assert checked["code"] == "nan_weights"
    assert checked["peak"] < size / 8, checked  # one read buffer, not the file
    good = _write_big(tmp_path / "good", nan=False)
    loaded = _peak("load", good, small)  # the float32 weights it returns, and one buffer
    assert loaded["code"] is None
    assert loaded["peak"] < size * 1.25, loaded  # not the file's bytes and copies of them too
