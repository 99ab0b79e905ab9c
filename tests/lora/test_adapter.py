"""Loading PEFT adapters: equality with PEFT itself, content hashes, and every refusal."""

from __future__ import annotations

import json
import math
import pickle
import shutil
import struct
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.lora.adapter import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterError,
    BaseModelInfo,
    LoRAAdapter,
    load_adapter,
)
from tests.utils.adapters import hf_config, make_peft

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PREFIX = "base_model.model.model.layers"


def lora_layer(peft_model: Any, layer: int, module: str) -> Any:
    block = peft_model.base_model.model.model.layers[layer]
    return getattr(block.self_attn if module in ALL[:4] else block.mlp, module)


@pytest.fixture(scope="module")
def base() -> BaseModelInfo:
    return BaseModelInfo.from_hf_config(hf_config("llama"))


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama, r=8, alpha=16, q_proj and v_proj: the adapter the refusal cases mutate."""
    out = tmp_path_factory.mktemp("good") / "good"
    make_peft(out, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return out


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every temporary directory the loader makes must be gone after the test."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    yield
    assert list(scratch.iterdir()) == []


# --- equality with PEFT ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "lora"),
    [
        ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
        ("qwen3", dict(r=8, lora_alpha=32, target_modules=ALL)),
        ("llama", dict(r=16, lora_alpha=16, target_modules=r".*\.(k_proj|down_proj)")),
        ("qwen3", dict(r=16, lora_alpha=8, target_modules=["o_proj", "up_proj"], use_rslora=True)),
    ],
    ids=["r4-list", "r8-all-qwen3-headdim", "r16-regex", "r16-rslora"],
)
def test_matches_peft(tmp_path: Path, arch: str, lora: dict[str, Any]) -> None:
    peft_model = make_peft(tmp_path / "a", arch, **lora)
    adapter = load_adapter(
        tmp_path / "a", BaseModelInfo.from_hf_config(hf_config(arch)), max_rank=16
    )

    r, alpha = lora["r"], lora["lora_alpha"]
    expected_scaling = alpha / math.sqrt(r) if lora.get("use_rslora") else alpha / r
    assert (adapter.name, adapter.rank, adapter.alpha) == ("a", r, alpha)
    assert adapter.scaling == pytest.approx(expected_scaling)
    assert adapter.uniform
    peft_keys = {
        (int(n.split(".")[4]), n.split(".")[-1])
        for n, m in peft_model.named_modules()
        if hasattr(m, "lora_A") and "default" in m.lora_A
    }
    assert set(adapter.weights) == peft_keys
    assert adapter.target_modules == tuple(sorted({m for _, m in peft_keys}))
    for (layer, module), (a, b) in adapter.weights.items():
        peft_layer = lora_layer(peft_model, layer, module)
        assert a.dtype == b.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
        assert torch.equal(a, peft_layer.lora_A["default"].weight.detach())
        assert torch.equal(b, peft_layer.lora_B["default"].weight.detach())
        assert adapter.scaling_of(layer, module) == pytest.approx(peft_layer.scaling["default"])
        torch.testing.assert_close(
            adapter.delta_weight(layer, module), peft_layer.get_delta_weight("default")
        )
    assert adapter.size_bytes == sum(a.nbytes + b.nbytes for a, b in adapter.weights.values())

    # The merged base weight moves by exactly our delta.
    layer, module = max(adapter.weights)
    peft_layer = lora_layer(peft_model, layer, module)
    before = peft_layer.base_layer.weight.detach().clone()
    peft_layer.merge()
    merged_delta = peft_layer.base_layer.weight.detach() - before
    torch.testing.assert_close(
        merged_delta, adapter.delta_weight(layer, module), atol=1e-5, rtol=1e-4
    )


def test_rank_and_alpha_patterns(tmp_path: Path, base: BaseModelInfo) -> None:
    peft_model = make_peft(
        tmp_path / "a",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        rank_pattern={"v_proj": 8},
        alpha_pattern={r"layers\.1\.self_attn\.q_proj": 32},
    )
    adapter = load_adapter(tmp_path / "a", base, max_rank=8)
    assert adapter.rank == 8 and adapter.scaling == 2.0 and not adapter.uniform
    for layer, module in adapter.weights:
        peft_layer = lora_layer(peft_model, layer, module)
        assert adapter.rank_of(layer, module) == peft_layer.r["default"]
        assert adapter.scaling_of(layer, module) == pytest.approx(peft_layer.scaling["default"])
    assert adapter.scaling_of(1, "q_proj") == 8.0 and adapter.rank_of(0, "v_proj") == 8
    with pytest.raises(AdapterError) as info:
        load_adapter(tmp_path / "a", base, max_rank=4)
    assert info.value.code == "rank_too_large" and "v_proj" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_converted(
    tmp_path: Path, base: BaseModelInfo, good: Path, dtype: torch.dtype
) -> None:
    ref = load_adapter(good, base, max_rank=16)
    half = tmp_path / "half"
    shutil.copytree(good, half)
    tensors = {k: v.to(dtype) for k, v in load_file(good / WEIGHTS_NAME).items()}
    save_file(tensors, half / WEIGHTS_NAME)
    adapter = load_adapter(half, base, max_rank=16)
    for key, (a, b) in adapter.weights.items():
        assert a.dtype == torch.float32
        assert torch.equal(a, ref.weights[key][0].to(dtype).float())
        assert torch.equal(b, ref.weights[key][1].to(dtype).float())
    assert adapter.content_hash != ref.content_hash


def test_base_model_info_shapes() -> None:
    qwen = BaseModelInfo.from_hf_config(hf_config("qwen3"))
    assert (qwen.architecture, qwen.head_dim, qwen.num_kv_heads) == ("Qwen3ForCausalLM", 32, 2)
    assert qwen.module_shape("q_proj") == (64, 128) and qwen.module_shape("o_proj") == (128, 64)
    assert qwen.module_shape("k_proj") == (64, 64) and qwen.module_shape("down_proj") == (128, 64)
    with pytest.raises(AdapterError) as info:
        qwen.module_shape("lm_head")
    assert info.value.code == "unsupported_target"


# --- content hash -------------------------------------------------------------------------


def pack(src: Path, out: Path, kind: str, nested: bool = True) -> Path:
    """Pack ``src`` as ``kind`` (zip, tar.gz, tgz), inside a folder when ``nested``."""
    files = sorted(p for p in src.iterdir() if p.is_file())
    arcname = (lambda p: f"{src.name}/{p.name}") if nested else (lambda p: p.name)
    if kind == "zip":
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
            for p in reversed(files):
                zf.write(p, arcname(p))
    else:
        with tarfile.open(out, "w:gz") as tf:
            for p in files:
                tf.add(p, arcname(p))
    return out


def test_hash_independent_of_packaging(tmp_path: Path, base: BaseModelInfo, good: Path) -> None:
    ref = load_adapter(good, base, max_rank=16)
    sources = [
        pack(good, tmp_path / "a.zip", "zip"),
        pack(good, tmp_path / "a.tar.gz", "tar.gz"),
        pack(good, tmp_path / "b.tgz", "tgz", nested=False),
    ]
    for source in sources:
        adapter = load_adapter(source, base, max_rank=16)
        assert adapter.content_hash == ref.content_hash, source.name
        assert all(torch.equal(adapter.weights[k][0], ref.weights[k][0]) for k in ref.weights)
    assert [load_adapter(s, base, max_rank=16).name for s in sources] == ["a", "a", "b"]
    assert load_adapter(sources[0], base, max_rank=16, name="mine").name == "mine"


def test_hash_ignores_names_order_and_advisory_fields(
    tmp_path: Path, base: BaseModelInfo, good: Path
) -> None:
    ref = load_adapter(good, base, max_rank=16).content_hash
    other = tmp_path / "other"
    shutil.copytree(good, other)
    tensors = load_file(good / WEIGHTS_NAME)
    renamed = {k.replace(".weight", ".default.weight"): v for k, v in reversed(tensors.items())}
    save_file(renamed, other / WEIGHTS_NAME, metadata={"format": "pt", "note": "x"})
    edit_config(other, base_model_name_or_path="elsewhere", lora_dropout=0.3, inference_mode=False)
    assert load_adapter(other, base, max_rank=16).content_hash == ref


def test_hash_changes_with_content(tmp_path: Path, base: BaseModelInfo, good: Path) -> None:
    ref = load_adapter(good, base, max_rank=16).content_hash
    make_peft(tmp_path / "seed1", seed=1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    assert load_adapter(tmp_path / "seed1", base, max_rank=16).content_hash != ref
    alpha = tmp_path / "alpha"
    shutil.copytree(good, alpha)
    edit_config(alpha, lora_alpha=32)
    assert load_adapter(alpha, base, max_rank=16).content_hash != ref


# --- refusals --------------------------------------------------------------------------------


def edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / CONFIG_NAME).read_text())
    cfg.update(changes)
    (path / CONFIG_NAME).write_text(json.dumps(cfg))


def edit_tensors(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / WEIGHTS_NAME)
    change(tensors)
    save_file(tensors, path / WEIGHTS_NAME)


def write_raw(path: Path, header: dict[str, Any], data: bytes, length: int | None = None) -> None:
    blob = json.dumps(header).encode()
    size = len(blob) if length is None else length
    (path / WEIGHTS_NAME).write_bytes(struct.pack("<Q", size) + blob + data)


def name(layer: int, module: str, which: str) -> str:
    parent = "self_attn" if module in ALL[:4] else "mlp"
    return f"{PREFIX}.{layer}.{parent}.{module}.lora_{which}.weight"


def f32(shape: list[int], begin: int) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + 4 * math.prod(shape)]}


Mutation = Callable[[Path], object]


def _set(**changes: Any) -> Mutation:
    return lambda p: edit_config(p, **changes)


def _tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Mutation:
    return lambda p: edit_tensors(p, change)


def _pickle(p: Path) -> None:
    (p / WEIGHTS_NAME).unlink()
    (p / "adapter_model.bin").write_bytes(b"\x80\x04\x95cos\nsystem\n.")


def _dup_key(p: Path) -> None:
    (p / CONFIG_NAME).write_text((p / CONFIG_NAME).read_text()[:-1] + ', "r": 64}')


def _raw_json(text: str) -> Mutation:
    return lambda p: (p / CONFIG_NAME).write_text(text)


def _deep_header(p: Path) -> None:
    blob = b"[" * 100_000 + b"]" * 100_000
    (p / WEIGHTS_NAME).write_bytes(struct.pack("<Q", len(blob)) + blob)


def _raw(header: dict[str, Any], data: bytes, length: int | None = None) -> Mutation:
    return lambda p: write_raw(p, header, data, length)


def _add(key: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__setitem__(key, value)


def _drop(key: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__delitem__(key)


def _poke(key: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(t: dict[str, torch.Tensor]) -> None:
        t[key] = t[key].clone()
        t[key][0, 0] = value

    return change


def _rank4_q(t: dict[str, torch.Tensor]) -> None:
    t[name(0, "q_proj", "A")] = torch.randn(4, 64)
    t[name(0, "q_proj", "B")] = torch.randn(64, 4)


A0 = name(0, "q_proj", "A")
ONE = {A0: f32([8, 64], 0)}
CASES: dict[str, tuple[Mutation, str, str]] = {
    "no-config": (lambda p: (p / CONFIG_NAME).unlink(), "missing_file", "save_pretrained"),
    "no-weights": (lambda p: (p / WEIGHTS_NAME).unlink(), "missing_file", WEIGHTS_NAME),
    "pickle": (_pickle, "pickle_format", "safe_serialization=True"),
    "bad-json": (_raw_json("{not json"), "bad_config", "not valid JSON"),
    "json-list": (_raw_json("[1]"), "bad_config", "JSON object"),
    "dup-key": (_dup_key, "bad_config", "duplicate key"),
    "deep-json": (_raw_json("[" * 100_000 + "]" * 100_000), "bad_config", "nested too deeply"),
    "nan-alpha": (_set(lora_alpha=float("nan")), "bad_config", "NaN"),
    "peft-type": (_set(peft_type="IA3"), "bad_config", "peft_type"),
    "r-zero": (_set(r=0), "bad_config", "positive integer"),
    "r-str": (_set(r="8"), "bad_config", "positive integer"),
    "r-bool": (_set(r=True), "bad_config", "positive integer"),
    "rank": (_set(r=32), "rank_too_large", "retrain with r <= 16"),
    "alpha-str": (_set(lora_alpha="16"), "bad_config", "lora_alpha"),
    "lm-head": (_set(target_modules=["q_proj", "lm_head"]), "unsupported_target", "q_proj, k_proj"),
    "embed": (_set(target_modules=["embed_tokens"]), "unsupported_target", "embed_tokens"),
    "regex-all": (_set(target_modules=".*"), "unsupported_target", "lm_head"),
    "regex-head": (_set(target_modules=r".*\.(q|v)_proj|lm_head"), "unsupported_target", "lm_head"),
    "regex-none": (_set(target_modules="nothing"), "bad_config", "matches no module"),
    "regex-invalid": (_set(target_modules="(q_proj"), "bad_config", "regular expression"),
    "targets-none": (_set(target_modules=None), "bad_config", "target_modules"),
    "dora": (_set(use_dora=True), "dora_unsupported", "use_dora=False"),
    "modules-to-save": (
        _set(modules_to_save=["lm_head"]),
        "modules_to_save",
        "modules_to_save=None",
    ),
    "bias": (_set(bias="lora_only"), "bias_unsupported", 'bias="none"'),
    "lora-bias": (_set(lora_bias=True), "bias_unsupported", "lora_bias=False"),
    "tokens": (_set(trainable_token_indices=[1]), "unsupported_target", "plain LoRA"),
    "alora": (_set(alora_invocation_tokens=[1]), "unsupported_option", "plain LoRA"),
    "rank-pattern": (_set(rank_pattern={"q_proj": 0}), "bad_config", "rank_pattern"),
    "untargeted": (_set(target_modules=["q_proj"]), "unexpected_tensor", "target_modules"),
    "layers": (_set(layers_to_transform=[0]), "unexpected_tensor", "layers.1"),
    "missing-b": (_tensors(_drop(name(1, "v_proj", "B"))), "missing_tensor", "lora_B of layer 1"),
    "embed-tensor": (
        _tensors(_add("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(8, 96))),
        "unsupported_target",
        "embed_tokens",
    ),
    "bias-tensor": (
        _tensors(_add(f"{PREFIX}.0.self_attn.q_proj.lora_B.bias", torch.zeros(64))),
        "bias_unsupported",
        "bias",
    ),
    "magnitude": (
        _tensors(_add(f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", torch.ones(64))),
        "dora_unsupported",
        "DoRA",
    ),
    "fused-name": (
        _tensors(_add(f"{PREFIX}.0.self_attn.qkv_proj.lora_A.weight", torch.ones(8, 64))),
        "unsupported_target",
        "qkv_proj",
    ),
    "odd-name": (
        _tensors(_add("foo", torch.ones(1))),
        "unexpected_tensor",
        "not a PEFT LoRA weight",
    ),
    "padded-layer": (
        _tensors(_add(name(0, "q_proj", "A").replace(".0.", ".00."), torch.ones(8, 64))),
        "unexpected_tensor",
        "not a PEFT LoRA weight",
    ),
    "duplicate": (
        _tensors(_add(A0.replace(".weight", ".default.weight"), torch.ones(8, 64))),
        "unexpected_tensor",
        "same weight",
    ),
    "rank-mismatch": (_tensors(_rank4_q), "bad_shape", "rank 8"),
    "wrong-base": (
        _tensors(_add(name(0, "v_proj", "B"), torch.ones(64, 8))),
        "base_model_mismatch",
        "64 -> 32 in the base model",
    ),
    "layer-out-of-range": (
        _tensors(
            lambda t: t.update(
                {name(5, "q_proj", w): t[name(0, "q_proj", w)].clone() for w in "AB"}
            )
        ),
        "base_model_mismatch",
        "has 2 layers",
    ),
    "nan": (_tensors(_poke(A0, float("nan"))), "nan_weights", "NaN"),
    "inf": (_tensors(_poke(name(1, "v_proj", "B"), float("-inf"))), "nan_weights", "Inf"),
    "int-dtype": (_tensors(_add(A0, torch.ones(8, 64, dtype=torch.int32))), "bad_dtype", "float16"),
    "f64": (_tensors(_add(A0, torch.ones(8, 64, dtype=torch.float64))), "bad_dtype", "F64"),
    "empty": (_raw({}, b""), "bad_safetensors", "no LoRA weights"),
    "truncated": (
        lambda p: (p / WEIGHTS_NAME).write_bytes(b"\x10\x00"),
        "bad_safetensors",
        "shorter",
    ),
    "huge-header": (_raw(ONE, bytes(2048), length=1 << 62), "bad_safetensors", "header length"),
    "header-not-json": (_raw(ONE, bytes(2048), length=3), "bad_safetensors", "not valid JSON"),
    "header-deep": (_deep_header, "bad_safetensors", "nested too deeply"),
    "beyond-file": (_raw(ONE, bytes(100)), "bad_safetensors", "outside the file"),
    "lying-size": (
        _raw({A0: {"dtype": "F32", "shape": [8, 64], "data_offsets": [0, 100]}}, bytes(100)),
        "bad_safetensors",
        "needs 2048",
    ),
    "overlap": (
        _raw({A0: f32([8, 64], 0), name(0, "q_proj", "B"): f32([64, 8], 1024)}, bytes(3072)),
        "bad_safetensors",
        "overlaps",
    ),
    "trailing": (_raw(ONE, bytes(4096)), "bad_safetensors", "belong to no tensor"),
    "extra-field": (
        _raw({A0: {**f32([8, 64], 0), "evil": 1}}, bytes(2048)),
        "bad_safetensors",
        "exactly dtype",
    ),
    "negative-shape": (
        _raw({A0: {"dtype": "F32", "shape": [-8, -64], "data_offsets": [0, 2048]}}, bytes(2048)),
        "bad_safetensors",
        "malformed",
    ),
}


@pytest.mark.parametrize("packaging", ["dir", "zip"])
@pytest.mark.parametrize("case", list(CASES))
def test_refused(
    tmp_path: Path, base: BaseModelInfo, good: Path, case: str, packaging: str
) -> None:
    mutate, code, hint = CASES[case]
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    mutate(bad)
    source = bad if packaging == "dir" else pack(bad, tmp_path / "bad.zip", "zip")
    with pytest.raises(AdapterError) as info:
        load_adapter(source, base, max_rank=16)
    assert info.value.code == code, str(info.value)
    assert hint in str(info.value)


def test_weights_over_size_limit(base: BaseModelInfo, good: Path) -> None:
    with pytest.raises(AdapterError) as info:
        load_adapter(good, base, max_rank=16, max_bytes=1000)
    assert info.value.code == "too_large" and "size limit" in str(info.value)


def test_archive_over_size_limit(tmp_path: Path, base: BaseModelInfo, good: Path) -> None:
    with pytest.raises(AdapterError) as info:
        load_adapter(pack(good, tmp_path / "a.zip", "zip"), base, max_rank=16, max_bytes=1000)
    assert info.value.code == "archive_too_large"


def test_missing_source(tmp_path: Path, base: BaseModelInfo) -> None:
    with pytest.raises(AdapterError) as info:
        load_adapter(tmp_path / "nope", base, max_rank=16)
    assert info.value.code == "missing_file"


def test_regex_time_budget(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, base: BaseModelInfo, good: Path
) -> None:
    monkeypatch.setattr("loraplex.lora.adapter._PATTERN_BUDGET_S", 0.0)
    shutil.copytree(good, tmp_path / "a")
    edit_config(tmp_path / "a", target_modules=r".*\.(q|v)_proj")
    with pytest.raises(AdapterError) as info:
        load_adapter(tmp_path / "a", base, max_rank=16)
    assert info.value.code == "bad_config" and "too long" in str(info.value)


def test_all_linear_and_exclude(tmp_path: Path, base: BaseModelInfo, good: Path) -> None:
    shutil.copytree(good, tmp_path / "a")
    edit_config(tmp_path / "a", target_modules="all-linear", exclude_modules=["k_proj"])
    adapter: LoRAAdapter = load_adapter(tmp_path / "a", base, max_rank=16)
    assert adapter.target_modules == ("q_proj", "v_proj")
    edit_config(tmp_path / "a", target_modules="all-linear", exclude_modules=r".*v_proj")
    with pytest.raises(AdapterError) as info:
        load_adapter(tmp_path / "a", base, max_rank=16)
    assert info.value.code == "unexpected_tensor" and "v_proj" in str(info.value)


def test_tenant_strings_in_messages_are_bounded(
    tmp_path: Path, base: BaseModelInfo, good: Path
) -> None:
    shutil.copytree(good, tmp_path / "a")
    edit_config(tmp_path / "a", target_modules=["x" * 100_000])
    with pytest.raises(AdapterError) as info:
        load_adapter(tmp_path / "a", base, max_rank=16)
    assert info.value.code == "unsupported_target" and len(str(info.value)) < 400


def test_records_cross_process_boundaries(base: BaseModelInfo, good: Path) -> None:
    """The engine core is a child process: errors and adapters must survive pickling (trusted IPC)."""
    err = pickle.loads(pickle.dumps(AdapterError("bad_shape", "fix it")))
    assert (type(err), err.code, str(err)) == (AdapterError, "bad_shape", "fix it")
    adapter = load_adapter(good, base, max_rank=16)
    copy = pickle.loads(pickle.dumps(adapter))
    assert copy.content_hash == adapter.content_hash and copy.scalings == adapter.scalings
    assert all(torch.equal(copy.weights[k][1], adapter.weights[k][1]) for k in adapter.weights)
