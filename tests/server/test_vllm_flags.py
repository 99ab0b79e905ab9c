"""vLLM's ``serve`` flags on ``loraplex serve``: KServe's argv for a LoRA service parses into the
configuration it means, ``--lora-modules`` takes both forms, and TLS options are checked before
the engine starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from loraplex import cli
from loraplex.cli import build_parser
from loraplex.engine_args import from_args
from loraplex.server.serve import apply_default_policy
from loraplex.server.vllm_flags import lora_module, uvicorn_options
from tests.utils.kserve import kserve_argv


def parse(argv: list[str]) -> argparse.Namespace:
    args, extra = build_parser().parse_known_args(argv)
    assert not extra, extra
    return args


def test_kserves_lora_service_argv_parses_into_what_it_means(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapters = {"a": "/mnt/lora/a", "b": "/mnt/lora/b"}
    argv = kserve_argv(tmp_path, "/mnt/models", "/tls", adapters)
    assert argv[0] == "serve" and "--enable-lora" in argv and "--max-lora-rank=64" in argv
    assert " " in argv  # the template's stray blank word
    served: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "_serve", lambda args: served.append(args) or 0)
    assert cli.main(argv) == 0  # the whole command line, the blank word too
    (args,) = served
    assert args.model == "/mnt/models" and args.port == 8000
    assert args.served_model_name == "tiny"
    assert args.served_model_aliases == ["publishers/ns/models/tiny"]
    assert args.lora_modules == [
        ("a", "/mnt/lora/a"),
        ("publishers/ns/models/a", "/mnt/lora/a"),
        ("b", "/mnt/lora/b"),
        ("publishers/ns/models/b", "/mnt/lora/b"),
    ]
    assert (args.ssl_certfile, args.ssl_keyfile) == ("/tls/tls.crt", "/tls/tls.key")
    assert args.enable_ssl_refresh and args.disable_uvicorn_access_log and args.enable_lora
    lora = from_args(apply_default_policy(args), model=args.model).lora
    assert (lora.max_lora_rank, lora.max_loras, lora.max_cpu_loras) == (64, 2, 4)


def test_newer_kserve_templates_flags_parse() -> None:
    """What the template adds when ``vllm --version`` says 0.16 / 0.18 or later."""
    args = parse(
        ["serve", "/m", "--served-model-name", "x", "--disable-access-log-for-endpoints",
         "/health,/metrics,/ping", "--shutdown-timeout", "15", "--tensor-parallel-size=1"]
    )  # fmt: skip
    assert args.disable_access_log_for_endpoints == "/health,/metrics,/ping"
    assert args.shutdown_timeout == 15.0 and args.served_model_aliases == []


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("sql=/a/b", ("sql", "/a/b")),
        ('{"name": "sql", "path": "/a/b"}', ("sql", "/a/b")),
        ('{"name":"x/y","path":"/p","base_model_name":"m"}', ("x/y", "/p")),
        ('\'{"name":"q","path":"/p"}\'', ("q", "/p")),  # KServe's quotes, not eval'd
    ],
)
def test_lora_modules_take_both_forms(text: str, want: tuple[str, str]) -> None:
    assert lora_module(text) == want


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("sql", "NAME=PATH"),
        ('{"name": "sql"', "not valid JSON"),
        ('{"name": "sql", "path": ""}', "non-empty name and path"),
        ('{"name": "s", "path": "/p", "rank": 8}', "rank"),
        ('["s", "/p"]', "NAME=PATH"),
    ],
)
def test_bad_lora_modules_say_what_is_expected(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        lora_module(text)


def test_a_bad_lora_module_is_one_usage_line(capsys: pytest.CaptureFixture[str]) -> None:
    from loraplex.cli import main

    assert main(["serve", "--lora-modules", '{"name": "x"}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "non-empty name and path" in err[0]


def test_tls_options_are_checked_before_the_engine_starts(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    ok = parse(["serve", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    assert uvicorn_options(ok) == {
        "access_log": True,
        "ssl_certfile": str(cert),
        "ssl_keyfile": str(key),
    }
    for argv, says in (
        (["--ssl-certfile", str(cert)], "go together"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "no")], "no such file"),
        (["--enable-ssl-refresh"], "needs --ssl-certfile"),
    ):
        with pytest.raises(ValueError, match=says):
            uvicorn_options(parse(["serve", *argv]))


class _SpyContext:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, str]] = []

    def load_cert_chain(self, certfile: str, keyfile: str) -> None:
        self.loaded.append((certfile, keyfile))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the server runs on asyncio
@pytest.mark.anyio
async def test_ssl_refresh_loads_a_renewed_certificate_into_the_servers_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    import os
    import types

    from loraplex.server import vllm_flags

    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("old")
    key.write_text("old")
    monkeypatch.setattr(vllm_flags, "SSL_REFRESH_INTERVAL_S", 0.01)
    args = parse(["serve", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                  "--enable-ssl-refresh"])  # fmt: skip
    context = _SpyContext()
    server = types.SimpleNamespace(config=types.SimpleNamespace(ssl=context))
    async with vllm_flags.ssl_refresh(args, server):
        await asyncio.sleep(0.05)
        assert context.loaded == []  # unchanged files: nothing loaded
        cert.write_text("new")
        os.utime(cert, (1e9, 2e9))  # a renewal changes the modification time
        for _ in range(100):
            if context.loaded:
                break
            await asyncio.sleep(0.01)
    assert context.loaded == [(str(cert), str(key))]


def test_access_log_lines_of_the_named_endpoints_are_dropped() -> None:
    import logging

    from loraplex.server.vllm_flags import quiet_access_log

    quiet_access_log(parse(["serve", "--disable-access-log-for-endpoints", "/health, /metrics"]))
    access = logging.getLogger("uvicorn.access")
    try:

        def record(path: str) -> logging.LogRecord:
            args = ("1.2.3.4:5", "GET", path, "1.1", 200)
            return logging.LogRecord(
                "uvicorn.access", 20, "", 0, '%s - "%s %s HTTP/%s" %d', args, None
            )

        assert not access.filter(record("/health")) and not access.filter(record("/metrics?x=1"))
        assert access.filter(record("/v1/models"))
    finally:
        for f in list(access.filters):
            access.removeFilter(f)
