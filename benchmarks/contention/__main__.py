"""``python -m benchmarks.contention``: see ``run.py``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks._cli import run_main
from benchmarks.contention.options import add_contention_arguments, options_from

DESCRIPTION = (
    "Run the workload of loraplex bench throughput and a batch-1 decode quiet and with N "
    "competing busy processes, in paired alternating runs, one loraplex child process per "
    "OpenMP spin setting (optionally vLLM beside it, with --vllm-python), and report "
    "tokens/s, step-time percentiles, busy/quiet and loraplex/vLLM ratios, and batch-1 decode "
    "as a fraction of copy bandwidth / weight bytes per token. Writes JSON and Markdown to "
    "--output-dir."
)


def _run(args: argparse.Namespace) -> int:
    from benchmarks.contention.run import run_contention

    run_contention(options_from(args))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main("contention", DESCRIPTION, add_contention_arguments, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
