"""``loraplex serve``: the OpenAI-compatible server with the engine in its own supervised process.

Every flag can also be set by environment, ``LORAPLEX_<FLAG>`` (``--max-loras`` ->
``LORAPLEX_MAX_LORAS``); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from loraplex.argtypes import byte_size, env_bool, positive_int
from loraplex.config import SchedulingPolicy
from loraplex.engine.client import EngineClient
from loraplex.engine.dp_router import ROUTING_POLICIES
from loraplex.engine_args import ENV_PREFIX, add_engine_arguments, from_args
from loraplex.server import vllm_flags
from loraplex.server.metrics_server import MetricsPort


def _env_default(flag: str, default: Any, cast: Callable[[str], Any] = str) -> Any:
    raw = os.environ.get(ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper())
    if raw is None:
        return default
    try:
        return cast(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(
            f"{ENV_PREFIX}{flag.lstrip('-').replace('-', '_').upper()}={raw!r} is not a valid "
            f"value for {flag}: {exc}"
        ) from None


# The scheduling policy when --scheduling-policy is not given: with tenants, each backlogged one
# gets its weight's share (engine/fair_queue.py); one caller alone, first come first served.
PLATFORM_POLICY: SchedulingPolicy = "fair"
OFFLINE_POLICY: SchedulingPolicy = "fcfs"


_lora_module = vllm_flags.lora_module  # NAME=PATH or vLLM's {"name": .., "path": ..}


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    def opt(flag: str, default: Any, cast: Callable[[str], Any] = str, **kw: Any) -> None:
        p.add_argument(flag, default=_env_default(flag, default, cast), type=cast, **kw)

    p.add_argument(
        "model",
        nargs="?",
        default=os.environ.get(ENV_PREFIX + "MODEL"),
        metavar="MODEL",
        help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    opt("--host", "127.0.0.1", help="address to listen on")
    opt("--port", 8000, int)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        action=vllm_flags.ServedModelNames,
        default=_env_default("--served-model-name", None),
        metavar="NAME",
        help="the base model's name in the API; more names are aliases of it (vLLM's form)",
    )
    opt(
        "--api-key",
        None,
        help="the operator's key ('Authorization: Bearer KEY'); with the platform on, the same "
        "as LORAPLEX_ADMIN_TOKEN (prefer the environment: flags show in `ps`)",
    )
    opt("--metrics-token", None, help="token that may also read /metrics (Prometheus scrapers)")
    opt(
        "--metrics-port",
        None,
        positive_int,
        help="also serve GET /metrics, and nothing else, without credentials on this port (for "
        "the inference gateway's scrapers; fence it with a NetworkPolicy); from a snapshot "
        "taken every 0.5 s",
    )
    opt(
        "--max-request-bytes",
        None,
        byte_size,
        help="largest request body accepted: bytes (64KiB, 16MiB, 1G; default 4MiB); larger "
        "ones get 413",
    )
    opt(
        "--default-max-tokens",
        None,
        int,
        help="max_tokens of a chat request that sets none (default: up to the context); "
        "/v1/completions defaults to 16",
    )
    p.add_argument(
        "--lora-modules",
        nargs="*",
        type=_lora_module,
        default=[
            _lora_module(m) for m in os.environ.get(ENV_PREFIX + "LORA_MODULES", "").split() if m
        ],
        metavar="NAME=PATH",
        help="adapters to load at start (PEFT directories or archives): NAME=PATH or "
        '\'{"name": NAME, "path": PATH}\'',
    )
    vllm_flags.add_vllm_arguments(p, opt, _env_default)
    add_engine_arguments(
        p.add_argument_group("engine"),
        env=True,
        defaults_shown={
            "scheduling_policy": f"{PLATFORM_POLICY}; {OFFLINE_POLICY} with --no-platform"
        },
    )
    opt("--data-dir", None, help="database and adapter files (default ~/.local/share/loraplex)")
    opt("--database-url", None, help="any SQLAlchemy URL (default: SQLite in --data-dir)")
    opt(
        "--shared-state",
        None,
        choices=("auto", "local", "database"),
        help="where quota windows, admin sessions and adapter files live: 'database' lets "
        "several `serve` replicas share one database (default auto: database unless SQLite)",
    )
    p.add_argument(
        "--migrate",
        action=argparse.BooleanOptionalAction,
        default=_env_default("--migrate", True, env_bool),
        help="apply database migrations at start (--no-migrate: run `loraplex db upgrade` "
        "yourself)",
    )
    p.add_argument(
        "--share-prefix-cache",
        action="store_true",
        default=_env_default("--share-prefix-cache", False, env_bool),
        help="let tenants share the base model's prefix-cache blocks (default: salted per tenant)",
    )
    p.add_argument(
        "--gateway-mode",
        action="store_true",
        default=_env_default("--gateway-mode", False, env_bool),
        help="name every tenant adapter '<tenant>/<adapter>' in the API and the metrics: one "
        "routing key per adapter for a Kubernetes inference gateway (llm-d, GIE, KServe)",
    )
    p.add_argument(
        "--demo",
        action="store_true",
        default=_env_default("--demo", False, env_bool),
        help="create a demo tenant with a key and two small adapters, and print how to call them",
    )
    p.add_argument(
        "--no-platform",
        action="store_true",
        default=_env_default("--no-platform", False, env_bool),
        help="serve the OpenAI API alone: no database, tenants or admin UI (one --api-key)",
    )
    opt("--shutdown-timeout", 10.0, float, help="seconds to finish in-flight requests on SIGTERM")
    opt("--log-level", "info", choices=("debug", "info", "warning", "error"))
    p.add_argument(
        "--engine-in-process",
        action="store_true",
        default=_env_default("--engine-in-process", False, env_bool),
        help="run the engine in the server process (debugging; no crash isolation)",
    )
    opt(
        "--data-parallel-size",
        1,
        positive_int,
        help="engine replicas, each a supervised process with its own KV cache, adapter pool "
        "and share of the CPUs (one GPU each on CUDA); at most one per usable CPU (GPU)",
    )
    opt(
        "--dp-routing",
        "affinity",
        choices=ROUTING_POLICIES,
        help="how requests pick a replica: affinity (the replica holding the adapter and the "
        "prefix, within an imbalance bound) or round_robin",
    )


def apply_default_policy(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the scheduling policy set when neither the flag nor the environment set
    it: tenants share the engine fairly, one caller alone is served first come first served."""
    if args.scheduling_policy is None:
        args.scheduling_policy = OFFLINE_POLICY if args.no_platform else PLATFORM_POLICY
    return args


def run_serve(args: argparse.Namespace) -> int:
    from loraplex.engine.default_model import resolve_model_dir

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = from_args(apply_default_policy(args), model=args.model)
    model_dir = resolve_model_dir(args.model)
    return asyncio.run(_serve(args, config, model_dir))


async def _open_platform(args: argparse.Namespace) -> Any:
    """Open the database (migrating it unless --no-migrate) and make sure an admin token exists
    (printing a new one once); the app built on it serves tenants, keys, the registry, quotas,
    usage, the admin API and the admin UI."""
    import anyio.to_thread

    from loraplex.platform import admin_token
    from loraplex.platform.db import migrate
    from loraplex.platform.settings import TenancySettings
    from loraplex.platform.store import Store

    overrides: dict[str, Any] = {
        "data_dir": args.data_dir,
        "database_url": args.database_url,
        "shared_state": args.shared_state,
        "share_prefix_cache": args.share_prefix_cache or None,
        "gateway_mode": args.gateway_mode or None,
    }
    if args.api_key is not None and not os.environ.get(ENV_PREFIX + "ADMIN_TOKEN"):
        overrides["admin_token"] = args.api_key
    settings = TenancySettings(**{k: v for k, v in overrides.items() if v is not None})
    store = Store.open(settings)
    await anyio.to_thread.run_sync(
        lambda: migrate.prepare(store.db.engine, run_migrations=args.migrate)
    )
    start = await anyio.to_thread.run_sync(admin_token.ensure, store.db, store.settings)
    print(start.message(), file=sys.stderr, flush=True)
    return store


class _Server:
    """uvicorn's server, with SIGTERM/SIGINT handled by us: uvicorn re-raises a captured signal
    after its graceful shutdown, which would end the process with -SIGTERM instead of 0."""

    def __init__(self, config: Any) -> None:
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        self._server = Quiet(config)

    @property
    def uvicorn(self) -> Any:
        return self._server

    def request_exit(self) -> None:
        self._server.should_exit = True

    async def serve(self) -> None:
        await self._server.serve()


def build_engine_client(args: argparse.Namespace, config: Any, model_dir: str) -> EngineClient:
    """The engine ``serve`` runs: in this process (``--engine-in-process``), one supervised
    engine process, or ``--data-parallel-size`` of them behind the router."""
    from loraplex.engine.dp_client import DataParallelClient
    from loraplex.engine.inproc_client import InprocEngineClient
    from loraplex.engine.proc_client import ProcEngineClient

    size = args.data_parallel_size
    if size > 1:
        if args.engine_in_process:
            raise ValueError(
                "--engine-in-process runs one engine in the server process; drop it to run "
                f"--data-parallel-size {size} engine processes"
            )
        return DataParallelClient.of_processes(config, model_dir, size, args.dp_routing)
    if args.engine_in_process:
        return InprocEngineClient(config, model_dir)
    return ProcEngineClient(config, model_dir)


async def _serve(args: argparse.Namespace, config: Any, model_dir: str) -> int:
    import uvicorn

    from loraplex.platform.settings import load_settings
    from loraplex.server import create_app

    start = time.perf_counter()
    if args.gateway_mode and args.no_platform:
        raise ValueError("--gateway-mode names tenants' adapters: drop --no-platform to use it")
    metrics_port: MetricsPort | None = None
    client = build_engine_client(args, config, model_dir)
    await client.start()
    try:
        settings = load_settings(
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            metrics_token=args.metrics_token,
            max_request_bytes=args.max_request_bytes,
            default_max_tokens=args.default_max_tokens,
            lora_resolver_dir=args.lora_resolver_dir,
        )
        web = vllm_flags.uvicorn_options(args)
        store = None if args.no_platform else await _open_platform(args)
        app = create_app(client, settings, store=store)
        serving = app.platform.serving
        for alias in args.served_model_aliases:
            serving.resolver.add_base_alias(alias)
        await app.platform.operator_adapters.load_modules(args.lora_modules)
        names = [serving.resolver.base_name, *args.served_model_aliases]
        names += [name for name, _ in args.lora_modules]
        scheme = "https" if "ssl_certfile" in web else "http"
        base_url = f"{scheme}://{args.host}:{args.port}"
        print(
            f"loraplex: serving {', '.join(names)} on {base_url}/v1 "
            f"(engine ready in {time.perf_counter() - start:.1f} s; model {model_dir}; "
            f"dtype {client.info.dtype}: {client.info.dtype_reason})",
            file=sys.stderr,
            flush=True,
        )
        if store is not None:
            print(
                f"loraplex: admin UI on {base_url}/admin; database {store.db.engine.url!r}",
                file=sys.stderr,
                flush=True,
            )
        if args.demo and store is not None:
            from loraplex.platform.demo import demo_message, setup_demo

            demo = await setup_demo(app.platform)
            print(demo_message(demo, base_url, serving.resolver.base_name), flush=True)
        metrics_port = await MetricsPort.start(args, app.platform.metrics)
        server = _Server(
            uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                timeout_graceful_shutdown=int(args.shutdown_timeout),
                **web,
            )
        )
        vllm_flags.quiet_access_log(args)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # Graceful: stop accepting, let in-flight requests finish, shut the engine, exit 0.
            loop.add_signal_handler(sig, server.request_exit)
        async with vllm_flags.ssl_refresh(args, server.uvicorn):
            await server.serve()
    finally:
        if metrics_port is not None:
            await metrics_port.stop()
        await client.shutdown(timeout=args.shutdown_timeout)
    return 0
