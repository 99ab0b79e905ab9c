"""The ``vllm serve`` flags ``loraplex serve`` accepts, so that launchers written for vLLM run
loraplex unchanged: KServe's ``LLMInferenceServiceConfig`` template (``vllm serve /mnt/models
--served-model-name NAME publishers/NS/models/NAME --port 8000 ... --enable-lora
--max-lora-rank=64 --lora-modules '{"name": .., "path": ..}' ...``), llm-d's and AIBrix's
Deployments.

=================================  ===========================================================
flag                               in loraplex
=================================  ===========================================================
``--served-model-name A [B ...]``  A is the base model's name; B ... are aliases requests may
                                   use and /v1/models lists (responses echo A)
``--lora-modules``                 ``NAME=PATH`` or vLLM's JSON ``{"name", "path"[,
                                   "base_model_name"]}``; one path under two names is one
                                   engine copy
``--enable-lora``                  accepted: loraplex always serves adapters
``--flag=N``                       every flag (argparse)
``--ssl-certfile/--ssl-keyfile``   TLS served by uvicorn (``--ssl-ca-certs``: client certs)
``--enable-ssl-refresh``           the certificate files are read again when they change
``--disable-uvicorn-access-log``   no access log
``--disable-access-log-for-        no access-log lines for these paths (comma-separated)
endpoints``
``--lora-resolver-dir DIR``        vLLM's filesystem resolver (``operator_adapters``)
=================================  ===========================================================
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from loraplex.argtypes import env_bool

logger = logging.getLogger(__name__)

SSL_REFRESH_INTERVAL_S = 10.0
_JSON_KEYS = {"name", "path", "base_model_name"}


def lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` value: ``NAME=PATH``, or vLLM's JSON object ``{"name": ..,
    "path": ..}`` (``base_model_name`` accepted and unused: there is one base model). A value
    still wrapped in the single quotes KServe adds for its ``eval`` loses them."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == "'":
        text = text[1:-1].strip()
    if text.startswith("{"):
        return _json_module(text)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f'expected NAME=PATH or {{"name": NAME, "path": PATH}}, got {text!r}'
        )
    return name, path


def _json_module(text: str) -> tuple[str, str]:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {exc.msg}") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError(f'expected a JSON object {{"name", "path"}}, got {text!r}')
    unknown = sorted(set(raw) - _JSON_KEYS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r} has {', '.join(unknown)}; a LoRA module takes name, path and base_model_name"
        )
    name, path = raw.get("name"), raw.get("path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(f"{text!r} needs a non-empty name and path (strings)")
    return name, path


class ServedModelNames(argparse.Action):
    """``--served-model-name A [B ...]``: ``served_model_name`` = A (a string, as before),
    ``served_model_aliases`` = [B, ...]."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        names = [values] if isinstance(values, str) else list(values or [])
        if not names or len(set(names)) != len(names):
            parser.error(f"{option_string} takes distinct names, got {names}")
        namespace.served_model_name = names[0]
        namespace.served_model_aliases = names[1:]


def add_vllm_arguments(
    p: argparse.ArgumentParser, opt: Callable[..., None], env_default: Callable[..., Any]
) -> None:
    """The flags above that ``serve`` lacks (``opt``: serve's flag-with-environment helper)."""
    p.set_defaults(served_model_aliases=[])
    p.add_argument(
        "--enable-lora",
        action="store_true",
        default=False,
        help="accepted for vLLM's command lines (loraplex always serves adapters)",
    )
    opt("--ssl-certfile", None, help="serve HTTPS with this PEM certificate (chain)")
    opt("--ssl-keyfile", None, help="the certificate's private key (PEM)")
    opt("--ssl-ca-certs", None, help="CA bundle that client certificates must chain to")
    p.add_argument(
        "--enable-ssl-refresh",
        action="store_true",
        default=env_default("--enable-ssl-refresh", False, env_bool),
        help="read the certificate and key again when their files change (cert-manager "
        "renewals), without a restart",
    )
    p.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        default=env_default("--disable-uvicorn-access-log", False, env_bool),
        help="no HTTP access log",
    )
    opt(
        "--disable-access-log-for-endpoints",
        None,
        help="comma-separated paths whose requests are not in the access log "
        "(e.g. /health,/metrics)",
    )
    opt(
        "--lora-resolver-dir",
        None,
        help="a request from the operator for an unknown adapter X loads DIR/X/ (vLLM's "
        "filesystem resolver), checked like an upload",
    )


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's TLS and access-log keywords from the flags (ValueError for a TLS
    setup that cannot work, before the engine starts)."""
    cert, key, ca = args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs
    if (cert is None) != (key is None):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together; give both or neither")
    for flag, path in (("--ssl-certfile", cert), ("--ssl-keyfile", key), ("--ssl-ca-certs", ca)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    if args.enable_ssl_refresh and cert is None:
        raise ValueError("--enable-ssl-refresh needs --ssl-certfile and --ssl-keyfile")
    options: dict[str, Any] = {"access_log": not args.disable_uvicorn_access_log}
    if cert is not None:
        options.update(ssl_certfile=cert, ssl_keyfile=key)
    if ca is not None:
        import ssl

        options.update(ssl_ca_certs=ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


class _QuietPaths(logging.Filter):
    """Drops uvicorn access-log records of the given paths (``"%s - "%s %s HTTP/%s" %d"``:
    the path is the record's third argument, with its query string)."""

    def __init__(self, paths: set[str]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3:
            return str(args[2]).split("?", 1)[0] not in self.paths
        return True


def quiet_access_log(args: argparse.Namespace) -> None:
    """``--disable-access-log-for-endpoints``: filter those paths out of uvicorn's access log."""
    raw = args.disable_access_log_for_endpoints
    paths = {p.strip() for p in (raw or "").split(",") if p.strip()}
    if paths:
        logging.getLogger("uvicorn.access").addFilter(_QuietPaths(paths))


@contextlib.asynccontextmanager
async def ssl_refresh(args: argparse.Namespace, server: Any) -> AsyncIterator[None]:
    """``--enable-ssl-refresh``: while the block runs, every ``SSL_REFRESH_INTERVAL_S`` seconds
    load the certificate chain again into the server's SSL context when a file changed (new
    connections get the new certificate; open ones keep theirs)."""
    if not args.enable_ssl_refresh:
        yield
        return
    task = asyncio.create_task(_refresh_forever(args, server), name="ssl-refresh")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _refresh_forever(args: argparse.Namespace, server: Any) -> None:
    files = [Path(args.ssl_certfile), Path(args.ssl_keyfile)]

    def stamp() -> tuple[float, ...]:
        return tuple(f.stat().st_mtime for f in files)

    seen = stamp()
    while True:
        await asyncio.sleep(SSL_REFRESH_INTERVAL_S)
        try:
            now = stamp()
            context = getattr(getattr(server, "config", None), "ssl", None)
            if now != seen and context is not None:
                context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
                seen = now
                logger.info("TLS: loaded the certificate again (%s)", args.ssl_certfile)
        except (OSError, ValueError) as exc:  # a half-written renewal: the next round retries
            logger.warning("TLS: could not load the renewed certificate yet: %s", exc)
