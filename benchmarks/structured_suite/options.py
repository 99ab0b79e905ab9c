"""What ``python -m benchmarks.structured_suite`` is asked to do: ``SuiteOptions`` and its flags (only
the standard library, so the CLI builds its parser cheaply)."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

from loraplex.argtypes import positive_int

KINDS = ("json_schema", "regex", "choice", "grammar", "tools", "parse", "json_object", "refusal")


@dataclass(frozen=True)
class SuiteOptions:
    concurrency: int = 8  # requests in flight at once
    kinds: tuple[str, ...] = KINDS
    cases: str | None = None  # run only the cases whose name contains one of these (commas)
    model: str | None = None  # send every case to this model (the base or an adapter)
    base_url: str | None = None  # a running server instead of a fresh ``serve --demo``
    api_key: str | None = None  # with base_url: a key of a tenant that has the adapters
    serve_args: tuple[str, ...] = ()  # more flags for ``loraplex serve --demo``
    request_timeout_s: float = 600.0
    seed: int = 0  # sampled cases use seed + their index
    output_dir: str = "bench-results"

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown or not self.kinds:
            raise ValueError(f"--kinds takes some of {', '.join(KINDS)}; got {unknown or 'none'}")
        if (self.base_url is None) != (self.api_key is None):
            raise ValueError("--base-url and --api-key go together (a running server and a key)")
        if self.request_timeout_s <= 0:
            raise ValueError("--request-timeout-s must be more than 0")

    def command_line(self) -> str:
        argv = ["python", "-m", "benchmarks.structured_suite", f"--concurrency={self.concurrency}"]
        argv.append(f"--kinds={','.join(self.kinds)}")
        if self.cases:
            argv.append(f"--cases={self.cases}")
        if self.model:
            argv.append(f"--model={self.model}")
        if self.base_url:
            argv += [f"--base-url={self.base_url}", "--api-key=..."]
        if self.serve_args:
            argv.append(f"--serve-args={shlex.join(self.serve_args)}")
        argv += [f"--seed={self.seed}", f"--output-dir={self.output_dir}"]
        return shlex.join(argv)


def add_suite_arguments(p: argparse.ArgumentParser) -> None:
    d = SuiteOptions()
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=d.concurrency,
        help=f"requests in flight at once (default {d.concurrency})",
    )
    p.add_argument(
        "--kinds",
        type=_kinds,
        default=d.kinds,
        help=f"comma-separated kinds of case to run (default all: {','.join(KINDS)})",
    )
    p.add_argument(
        "--cases",
        default=None,
        metavar="TEXT[,TEXT...]",
        help="run only the cases whose name contains one of these",
    )
    p.add_argument(
        "--model",
        default=None,
        help="send every case to this model, the base or an adapter (default: half the cases "
        "to the demo adapters in turn, half to the base model)",
    )
    p.add_argument(
        "--base-url",
        default=None,
        help="test a running server (e.g. http://127.0.0.1:8000) instead of starting "
        "loraplex serve --demo; needs --api-key",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="with --base-url: an inference key of a tenant with adapters",
    )
    p.add_argument(
        "--serve-args",
        default="",
        metavar="ARGS",
        help="more flags for the server, as one string (e.g. '--max-num-seqs 16')",
    )
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument(
        "--seed", type=int, default=d.seed, help="the sampled cases' seed is this plus their index"
    )
    p.add_argument("--output-dir", default=d.output_dir, help="where the JSON goes")


def _kinds(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in KINDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected kinds from {', '.join(KINDS)} separated by commas; got {text!r}"
        )
    return names


def options_from(args: argparse.Namespace) -> SuiteOptions:
    return SuiteOptions(
        concurrency=args.concurrency,
        kinds=args.kinds,
        cases=args.cases,
        model=args.model,
        base_url=args.base_url,
        api_key=args.api_key,
        serve_args=tuple(shlex.split(args.serve_args)),
        request_timeout_s=args.request_timeout_s,
        seed=args.seed,
        output_dir=args.output_dir,
    )
