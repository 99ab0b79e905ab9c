"""``python -m benchmarks.structured_suite``: see ``run.py``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks._cli import run_main
from benchmarks.structured_suite.options import add_suite_arguments, options_from

DESCRIPTION = (
    "Start loraplex serve --demo and send, with the official openai client, JSON schemas "
    "(response_format), regex, choice and grammar constraints, tool calls (tool_choice "
    "required and named), parse() and requests that must get a 400, through the demo adapters "
    "and the base model, streamed and not; check every output and write the share of valid "
    "ones per kind as JSON to --output-dir."
)


def _run(args: argparse.Namespace) -> int:
    from benchmarks.structured_suite.run import run_suite

    result = run_suite(options_from(args))
    return 0 if result["totals"]["all"]["valid"] == result["totals"]["all"]["n"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_main("structured_suite", DESCRIPTION, add_suite_arguments, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
