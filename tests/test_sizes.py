"""One size syntax for every byte-size flag and setting (issue 31: ``--kv-cache-memory 150MB``
was refused although ``--lora-memory 150MB`` was accepted): ``150MB``, ``1.5GiB``, ``2G`` and
plain bytes mean the same everywhere, and garbage gets one clear message."""

from __future__ import annotations

import argparse

import pytest

from loraplex.argtypes import SIZE_HINT, byte_size, memory_size, parse_size
from loraplex.engine_args import engine_config, from_args
from loraplex.platform.settings import TenancySettings, load_settings
from loraplex.server.serve import add_serve_arguments

SIZES = [
    ("150MB", 150_000_000),
    ("150mb", 150_000_000),
    ("1.5GiB", 3 * 2**29),
    ("2G", 2_000_000_000),
    ("2Gi", 2 * 2**30),
    ("64KiB", 65_536),
    ("1_048_576", 2**20),
    ("157286400", 157_286_400),
    (" 4k ", 4000),
    ("9007199254740993", 2**53 + 1),  # exact, not rounded through a float
]
SIZE_FLAGS = ("--kv-cache-memory", "--lora-memory", "--max-request-bytes")
GARBAGE = [
    ("abc", "expected a size such as 150MB"),
    ("", "expected a size such as 150MB"),
    ("7XB", "unknown unit 'xb'"),
    ("-5MB", "more than 0"),
    ("0", "more than 0"),
    ("1e999", "not a finite number"),
    ("1.5", "not a whole number of bytes"),
    ("0.5B", "at least 1 byte"),
]


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("text", "size"), SIZES)
def test_every_size_flag_reads_a_size_the_same_way(text: str, size: int) -> None:
    assert parse_size(text) == byte_size(text) == memory_size(text) == size
    args = serve_args(*(arg for flag in SIZE_FLAGS for arg in (flag, text)))
    assert (args.kv_cache_memory, args.lora_memory, args.max_request_bytes) == (size,) * 3
    config = from_args(args)
    assert (config.cache.kv_cache_memory, config.lora.lora_memory) == (size, size)
    keywords = engine_config(None, kv_cache_memory=text, lora_memory=text)  # LLM(...) keywords
    assert (keywords.cache.kv_cache_memory, keywords.lora.lora_memory) == (size, size)


@pytest.mark.parametrize(("text", "message"), GARBAGE)
def test_garbage_gets_one_message_that_shows_a_size(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_size(text)
    for flag in SIZE_FLAGS:
        with pytest.raises(argparse.ArgumentError, match=message):
            serve_args(f"{flag}={text}")
    with pytest.raises(ValueError, match=f"kv_cache_memory: .*{message}"):
        engine_config(None, kv_cache_memory=text)


def test_a_fraction_is_only_for_lora_memory() -> None:
    assert memory_size("0.25") == 0.25 and memory_size("1.0") == 1.0
    with pytest.raises(argparse.ArgumentTypeError, match="not a whole number of bytes"):
        byte_size("0.25")
    with pytest.raises(ValueError) as refused:
        parse_size("0.25")
    assert SIZE_HINT in str(refused.value)


def test_settings_and_environment_take_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_MAX_ADAPTER_BYTES", "150MB")
    monkeypatch.setenv("LORAPLEX_MAX_REQUEST_BYTES", "1.5MiB")
    monkeypatch.setenv("LORAPLEX_KV_CACHE_MEMORY", "2G")
    assert TenancySettings().max_adapter_bytes == 150_000_000
    assert load_settings().max_request_bytes == 3 * 2**19
    args = serve_args()
    assert (args.max_request_bytes, args.kv_cache_memory) == (3 * 2**19, 2_000_000_000)
    monkeypatch.setenv("LORAPLEX_MAX_REQUEST_BYTES", "lots")
    with pytest.raises(ValueError, match=r"LORAPLEX_MAX_REQUEST_BYTES='lots'.*expected a size"):
        serve_args()
    monkeypatch.setenv("LORAPLEX_MAX_ADAPTER_BYTES", "lots")
    with pytest.raises(ValueError, match="expected a size such as 150MB"):
        TenancySettings()
