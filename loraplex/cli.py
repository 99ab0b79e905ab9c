"""The ``loraplex`` command: ``loraplex serve``, ``loraplex generate``, ``loraplex bench ...``,
``loraplex db ...`` (schema migrations) and ``loraplex admin ...`` (tenants, keys, admin token).

Every failure prints one line, ``loraplex: error: ...``, and exits non-zero (2 for usage errors,
1 for everything else); set ``LORAPLEX_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from loraplex import __version__
from loraplex.argtypes import positive_int

PROG = "loraplex"


class UsageError(Exception):
    """A bad command line (exit 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see: {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="Multi-tenant LoRA serving: one base model, many adapters."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    from loraplex.server.serve import add_serve_arguments

    add_serve_arguments(
        commands.add_parser(
            "serve",
            help="serve the OpenAI-compatible API (engine in a supervised child process)",
            description="Serve MODEL (default: the embedded SmolLM2-135M-Instruct) over an "
            "OpenAI-compatible HTTP API. Every flag can also be set as LORAPLEX_<FLAG>.",
        )
    )

    gen = commands.add_parser(
        "generate",
        help="generate text for one or more prompts with the offline engine",
        description="Run prompts through the engine (batched) and print each completion.",
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument(
        "--model",
        default=None,
        help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=positive_int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto")

    prep = commands.add_parser(
        "prepare",
        help="convert the model and build the native kernels now (for an image build)",
        description="Do once, now, what the first start would do: convert the embedded model "
        "(or resolve MODEL) into the cache, and build the native CPU kernels. Prints the model "
        "directory.",
    )
    prep.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )

    from loraplex.bench.registry import BENCHES

    bench = commands.add_parser("bench", help="benchmarks (results as JSON in bench-results/)")
    benches = bench.add_subparsers(dest="bench", metavar="BENCHMARK", parser_class=_Parser)
    benches.required = True
    for name, entry in BENCHES.items():
        entry.add_arguments(
            benches.add_parser(name, help=entry.help, description=entry.description)
        )
    from loraplex.platform.admin_cli import add_commands as add_platform_commands

    add_platform_commands(commands, _Parser)
    return parser


def _generate(args: argparse.Namespace) -> int:
    import time

    from loraplex import SamplingParams
    from loraplex.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    loaded = time.perf_counter() - start
    prompts: list[str] = list(args.prompts)
    if args.chat:
        tok = llm.get_tokenizer()
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in args.prompts
        ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = 0
    for prompt, out in zip(args.prompts, outs, strict=True):
        completion = out.outputs[0]
        tokens += len(completion.token_ids)
        print(f"### {prompt}\n{completion.text}\n[{completion.finish_reason}]\n")
    print(
        f"loraplex: model loaded in {loaded:.1f} s; {tokens} tokens in {seconds:.1f} s "
        f"({tokens / max(seconds, 1e-9):.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


def _prepare(args: argparse.Namespace) -> int:
    import time

    from loraplex.engine.default_model import resolve_model_dir
    from loraplex.kernels import native

    start = time.perf_counter()
    model_dir = resolve_model_dir(args.model)
    print(f"{PROG}: model ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    start = time.perf_counter()
    try:
        native.build_library()
        kernels = f"built in {time.perf_counter() - start:.1f} s"
    except native.NativeBuildError as exc:  # the torch paths serve without them
        kernels = f"not built ({_one_line(exc)}); the torch paths will be used"
    print(f"{PROG}: native CPU kernels {kernels}", file=sys.stderr)
    print(model_dir)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from loraplex.server.serve import run_serve

    return run_serve(args)


def _fail(message: str, code: int = 1) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())  # newlines in library messages would break "one line"
    return text or type(error).__name__


def _refuse_moved_bench(args: list[str]) -> None:
    from loraplex.bench.registry import MOVED

    if len(args) >= 2 and args[0] == "bench" and args[1] in MOVED:
        raise UsageError(
            f"'bench {args[1]}' moved out of the package: from a clone of the repository, run "
            f"{MOVED[args[1]]} {' '.join(args[2:])}".rstrip()
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code (0 on success)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        _refuse_moved_bench(args_list)
        parser = build_parser()
        args, extra = parser.parse_known_args(args_list)
        # A word of blanks is no argument: KServe's vLLM template passes one (its Go template
        # leaves "\ " in the line its shell evals), and vLLM's launchers must run unchanged.
        extra = [word for word in extra if word.strip()]
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "serve":
            return _serve(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "prepare":
            return _prepare(args)
        if args.command == "bench":
            from loraplex.bench.registry import BENCHES

            return BENCHES[args.bench].run(args)
        if args.command in ("db", "admin"):
            from loraplex.platform.admin_cli import run as run_platform_command

            return run_platform_command(args)
        raise UsageError(f"unknown command: {' '.join(args_list)}")
    except UsageError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:
        if os.environ.get("LORAPLEX_DEBUG"):
            raise
        from loraplex.engine.default_model import ModelResolutionError
        from loraplex.platform.db.migrate import MigrationError
        from loraplex.platform.errors import APIError

        known = isinstance(
            e,
            ModelResolutionError
            | MigrationError
            | APIError
            | ValueError
            | OSError
            | ImportError
            | MemoryError,
        )
        prefix = "" if known else f"{type(e).__name__}: "
        print(f"{PROG}: error: {prefix}{_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
