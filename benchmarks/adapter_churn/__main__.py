"""``python -m benchmarks.adapter_churn``: see ``run.py``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks._cli import run_main
from benchmarks.adapter_churn.options import add_churn_arguments, options_from

DESCRIPTION = (
    "Start loraplex serve (issue 30's scenario a or b) and, over HTTP with streaming clients: "
    "tenant B's first request on a never-used adapter against warm ones, then B's time to "
    "first token alone, beside tenant A's requests on one adapter, and beside A's requests "
    "over N adapters round robin (churn); errors per tenant, engine restarts, adapter loads, "
    "evictions and deferrals against engine steps, A's throughput. Writes JSON and a PNG to "
    "--output-dir."
)


def _run(args: argparse.Namespace) -> int:
    from benchmarks.adapter_churn.run import run_adapter_churn

    run_adapter_churn(options_from(args))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main("adapter_churn", DESCRIPTION, add_churn_arguments, _run, argv)


if __name__ == "__main__":
    sys.exit(main())
