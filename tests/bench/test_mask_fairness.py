"""``python -m benchmarks.masks``: its summary and command line (the server run is the bench's)."""

from __future__ import annotations

from typing import Any

from benchmarks._cli import parser_for
from benchmarks.masks.options import MaskOptions, add_mask_arguments
from benchmarks.masks.run import summarize
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
    args = parser_for("masks", add_mask_arguments).parse_args(["--streams", "8", "--window-s", "5"])
    assert (args.streams, args.window_s, args.policy) == (8, 5.0, "fair")
    assert "--streams=32" in MaskOptions().command_line()
