"""How each experiment runs as ``python -m benchmarks.<name> ...`` from the repository root: its
flags, its runner, and one-line errors like ``loraplex``'s (exit 2 for a bad command line, 1 for a
failure; ``LORAPLEX_DEBUG=1`` shows the traceback)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn


class UsageError(Exception):
    """A bad command line (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see: {self.prog} --help)")


def parser_for(
    name: str, add_arguments: Callable[[argparse.ArgumentParser], None], description: str = ""
) -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks.<name>``."""
    parser = _Parser(prog=f"python -m benchmarks.{name}", description=description or None)
    add_arguments(parser)
    return parser


def run_main(
    name: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse ``argv`` with ``add_arguments``' flags and return ``run``'s exit code."""
    parser = parser_for(name, add_arguments, description)
    try:
        return run(parser.parse_args(argv))
    except UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("LORAPLEX_DEBUG"):
            raise
        text = " ".join(str(e).split()) or type(e).__name__
        known = isinstance(e, ValueError | OSError | ImportError)
        prefix = "" if known else f"{type(e).__name__}: "
        print(f"{parser.prog}: error: {prefix}{text}", file=sys.stderr)
        return 1
