"""One table of engine knobs (``loraplex.engine_args``) for ``LLM(...)``, ``loraplex serve`` (flags
and ``LORAPLEX_*``) and ``loraplex bench``: every ``EngineConfig`` field is in it, and every
default comes from the config records."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from loraplex.argtypes import memory_size
from loraplex.config import EngineConfig
from loraplex.engine_args import (
    ENGINE_ARGS,
    EngineKwargs,
    add_engine_arguments,
    engine_config,
    from_args,
    knobs_of,
)
from loraplex.llm import LLM
from loraplex.server.serve import add_serve_arguments


def _config_fields() -> set[str]:
    """Every section record's fields, and the fields of ``EngineConfig`` that are not sections
    (a whole record as one knob: speculative_config)."""
    config = EngineConfig()
    names = set()
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value):
            names |= {f.name for f in dataclasses.fields(value)}
        else:
            names.add(section.name)
    return names - {"model"}


def test_every_config_field_is_a_knob_and_typed() -> None:
    assert {a.name for a in ENGINE_ARGS} == _config_fields()
    assert set(EngineKwargs.__annotations__) == _config_fields()


def test_defaults_are_the_config_records() -> None:
    assert knobs_of(engine_config()) == {a.name: a.default for a in ENGINE_ARGS}
    assert knobs_of(EngineConfig()) == knobs_of(engine_config())
    # LLM writes no default of its own: its knobs are keywords mapped by the table.
    params = inspect.signature(LLM.__init__).parameters
    assert [p for p in params if p not in ("self", "model", "engine")] == []


def test_keywords_map_to_the_config_and_back() -> None:
    config = engine_config("m", max_loras=8, block_size=32, enable_prefix_caching=False)
    assert config.model.model == "m" and config.lora.max_loras == 8
    assert config.cache.block_size == 32 and config.cache.enable_prefix_caching is False
    knobs = knobs_of(config)
    assert engine_config("m", **knobs) == config
    with pytest.raises(TypeError, match="max_lora"):
        engine_config(max_lora=8)  # a misspelt knob is named, never ignored
    with pytest.raises(ValueError, match="max_loras"):
        engine_config(max_loras=0)  # the config records validate


def test_serve_flags_and_environment() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    help_text = parser.format_help()
    for arg in ENGINE_ARGS:
        assert arg.flag in help_text, arg.flag
    args = parser.parse_args(["--max-loras", "8", "--no-enable-prefix-caching"])
    config = from_args(args)
    assert config.lora.max_loras == 8 and config.cache.enable_prefix_caching is False
    assert config.scheduler == EngineConfig().scheduler  # untouched knobs keep their defaults

    env = argparse.ArgumentParser()
    add_engine_arguments(
        env, env=True, environ={"LORAPLEX_MAX_LORAS": "6", "LORAPLEX_ENABLE_PREFIX_CACHING": "0"}
    )
    config = from_args(env.parse_args([]))
    assert config.lora.max_loras == 6 and config.cache.enable_prefix_caching is False
    assert from_args(env.parse_args(["--max-loras", "2"])).lora.max_loras == 2  # a flag wins
    with pytest.raises(ValueError, match="LORAPLEX_MAX_LORAS"):
        add_engine_arguments(
            argparse.ArgumentParser(), env=True, environ={"LORAPLEX_MAX_LORAS": "many"}
        )
    with pytest.raises(ValueError, match="LORAPLEX_DTYPE"):
        add_engine_arguments(
            argparse.ArgumentParser(), env=True, environ={"LORAPLEX_DTYPE": "float8"}
        )


@pytest.mark.parametrize(
    ("text", "value"),
    [("1500000", 1_500_000), ("625MB", 625_000_000), ("2GiB", 2 * 2**30), ("0.25", 0.25),
     ("1.0", 1.0), ("4k", 4000), ("1.5GB", 1_500_000_000)],
)  # fmt: skip
def test_lora_memory_takes_bytes_or_a_fraction(text: str, value: int | float) -> None:
    assert memory_size(text) == value
    assert engine_config(None, lora_memory=text).lora.lora_memory == value


@pytest.mark.parametrize(
    ("value", "message"),
    [("7XB", "unknown unit 'xb'"), ("-5MB", "more than 0"), ("abc", "expected a size such as 150MB"),
     (1.5, r"fraction of the KV cache must be in \(0, 1\]"), (0, "positive number of bytes"),
     (True, "bytes, a fraction or None")],
)  # fmt: skip
def test_bad_lora_memory_says_what_it_takes(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine_config(None, lora_memory=value)


def test_max_loras_is_bounded() -> None:
    assert engine_config(None, max_loras=256).lora.max_loras == 256
    with pytest.raises(ValueError, match=r"max_loras must be in \[1, 256\]"):
        engine_config(None, max_loras=257)
