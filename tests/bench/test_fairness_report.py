"""The fairness benchmark's arithmetic: percentiles, token windows, shares, the summary's
fair-over-fcfs ratios and targets, its flags. The load itself needs a server; this does not."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from loraplex.bench.fairness_options import FairnessOptions, add_fairness_arguments, options_from
from loraplex.bench.fairness_report import (
    fairness_table,
    percentile,
    series,
    shares,
    summarize,
    tokens_by_tenant,
    write_fairness_plot,
)
from loraplex.bench.http_load import StreamRecord


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 99) is None
    assert percentile([5.0], 99) == 5.0
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(list(reversed(values)), 0) == 1.0
    assert percentile(values, 100) == 100.0


def test_tokens_are_spread_over_the_chunks_inside_a_window() -> None:
    a = StreamRecord(tenant="a", sent=0.0, chunk_times=[1.0, 2.0, 3.0, 4.0], tokens=8)
    b = StreamRecord(tenant="b", sent=0.0, chunk_times=[2.5], tokens=3)
    failed = StreamRecord(tenant="b", sent=0.0, status=429)
    records = [a, b, failed]
    assert tokens_by_tenant(records, 2.0, 4.0) == {"a": 4.0, "b": 3.0}
    assert tokens_by_tenant(records, 10.0, 20.0) == {"a": 0.0, "b": 0.0}
    assert shares({"a": 3.0, "b": 1.0}) == {"a": 0.75, "b": 0.25}
    assert shares({"a": 0.0}) == {"a": 0.0}


def test_series_buckets_each_tenants_tokens() -> None:
    a = StreamRecord(tenant="a", sent=0.0, chunk_times=[1.0, 6.0], tokens=2)
    s = series([a], 0.0, 10.0)
    assert s["t"] == [0.0, 5.0]
    assert s["tokens"] == {"a": [1.0, 1.0]}


def _result(p99: float, tps: float, equal: float, weighted: float) -> dict[str, Any]:
    return {
        "flood": {
            "b_ttft": {"p99_s": p99},
            "output_tokens_per_s": tps,
            "b_ttft_over_time": [(1.0, p99), (4.0, None)],
        },
        "shares": {
            "equal": {"shares": {"a": equal, "b": 1 - equal}},
            "weighted": {"shares": {"a": weighted, "b": 1 - weighted}},
            "series": {"t": [0.0, 5.0], "tokens": {"a": [3.0, 1.0], "b": [1.0, 1.0]}},
            "weight_changed_at_s": 5.0,
        },
        "priority": {"urgent_ttft_p50_s": 0.2, "admitted_before_all_queued": "3/3"},
    }


def _runs() -> list[dict[str, Any]]:
    return [
        {"repeat": 0, "policy": "fcfs", "result": _result(10.0, 200.0, 0.8, 0.8)},
        {"repeat": 0, "policy": "fair", "result": _result(2.0, 190.0, 0.5, 0.75)},
        {"repeat": 1, "policy": "fair", "result": _result(4.0, 230.0, 0.52, 0.74)},
        {"repeat": 1, "policy": "fcfs", "result": _result(8.0, 200.0, 0.7, 0.7)},
    ]


def test_summary_pairs_each_repeat_and_checks_the_targets() -> None:
    summary = summarize(_runs(), ("fcfs", "fair"), repeats=2)
    assert summary["b_p99_ttft_fair_over_fcfs"] == [0.2, 0.5]
    assert summary["median_b_p99_ttft_fair_over_fcfs"] == pytest.approx(0.35)
    assert summary["throughput_fair_over_fcfs"] == [0.95, 1.15]
    assert summary["policies"]["fair"]["equal_share_a"] == pytest.approx(0.51)
    assert summary["met"] == {
        "flood_ttft": False,  # 0.35 > 0.25
        "flood_throughput": True,
        "equal_shares": True,
        "weighted_shares": True,
    }
    table = fairness_table(summary)
    assert "flood: B p99 TTFT (s)" in table and "target <= 0.25" in table


def test_one_policy_has_no_ratios() -> None:
    runs = [r for r in _runs() if r["policy"] == "fair"]
    summary = summarize(runs, ("fair",), repeats=2)
    assert "met" not in summary
    assert summary["policies"]["fair"]["b_p99_ttft_s"] == 3.0


def test_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra")
    path = tmp_path / "f.png"
    assert write_fairness_plot({"runs": _runs()}, path) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _parse(*argv: str) -> FairnessOptions:
    p = argparse.ArgumentParser()
    add_fairness_arguments(p)
    return options_from(p.parse_args(list(argv)))


def test_flags_become_options_and_a_command_line() -> None:
    opts = _parse("--policies", "fcfs,priority", "--flood-streams", "8", "--share-weight", "2")
    assert opts.policies == ("fcfs", "priority")
    assert opts.flood_streams == 8 and opts.share_weight == 2.0
    assert "--policies=fcfs,priority" in opts.command_line()
    assert "--flood-streams=8" in opts.command_line()


def test_bad_flags_say_what_is_expected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--policies", "fifo")
    assert "expected policies from" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 1"):
        FairnessOptions(flood_streams=0)
