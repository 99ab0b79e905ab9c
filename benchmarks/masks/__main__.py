"""``python -m benchmarks.masks``: see ``run.py``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks._cli import run_main
from benchmarks.masks.options import add_mask_arguments, options_from

DESCRIPTION = (
    "Against loraplex serve: tenant A keeps --streams requests open, in alternating windows "
    "without a constraint and with --regex; tenant B's TTFT p90 in each; the median "
    "heavy/plain ratio. Writes JSON to --output-dir."
)


def _run(args: argparse.Namespace) -> int:
    from benchmarks.masks.run import run_masks

    return 0 if run_masks(options_from(args))["summary"]["met"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_main("masks", DESCRIPTION, add_mask_arguments, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
