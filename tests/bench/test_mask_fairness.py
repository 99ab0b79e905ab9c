"""``loraplex bench masks``: its summary and command line (the server run is the bench's)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from loraplex.bench.mask_fairness import summarize
from loraplex.bench.mask_options import MaskOptions
from loraplex.cli import build_parser
from loraplex.grammar.precheck import check_regex


def _window(repeat: int, constrained: bool, p90: float | None) -> dict[str, Any]:
    return {"repeat": repeat, "constrained": constrained, "b_ttft": {"p90_s": p90}}


def test_summary_is_the_median_of_paired_ratios() -> None:
    windows = [
        _window(0, False, 1.0), _window(0, True, 1.2),
        _window(1, True, 3.0), _window(1, False, 1.0),
        _window(2, False, 2.0), _window(2, True, 2.0),
    ]  # fmt: skip
    summary = summarize(windows, 3)
    assert summary["b_p90_heavy_over_plain"] == [1.2, 3.0, 1.0]
    assert summary["median_b_p90_heavy_over_plain"] == 1.2
    assert summary["met"] is True
    assert summarize([_window(0, False, None), _window(0, True, 1.0)], 1)["met"] is False


def test_the_default_pattern_is_accepted_and_the_command_line_parses() -> None:
    check_regex(MaskOptions().regex, "regex")  # the bench measures what the engine accepts
    args = build_parser().parse_args(["bench", "masks", "--streams", "8", "--window-s", "5"])
    assert (args.streams, args.window_s, args.policy) == (8, 5.0, "fair")
    assert "--streams=32" in MaskOptions().command_line()


def test_the_cli_parser_does_not_import_the_bench_http_client() -> None:
    """``loraplex prepare`` runs where only the engine's dependencies are installed (the Docker
    image's install): building the parser must not import httpx through a bench module."""
    code = (
        "import sys; from loraplex.cli import build_parser; build_parser(); "
        "bad = sorted(m for m in sys.modules if m == 'httpx' or m.startswith('loraplex.bench.')"
        " and not m.endswith('_options') and m != 'loraplex.bench'); print(bad); "
        "sys.exit(1 if 'httpx' in bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
