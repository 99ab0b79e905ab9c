"""``python -m benchmarks.speculative`` end to end on a tiny model with an English word tokenizer: both
workloads in paired runs, the ratio, the acceptance rate, and equal outputs of both engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks._cli import parser_for
from benchmarks.speculative import (
    SpeculativeBenchOptions,
    add_speculative_arguments,
    options_from,
    run_speculative,
)
from tests.utils.models import english_tokenizer, make_tiny_model


def test_the_bench_writes_both_workloads(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=2)
    english_tokenizer(Path(model_dir))
    opts = SpeculativeBenchOptions(
        model=model_dir,
        repeats=2,
        copy_prompts=2,
        copy_min_words=20,
        copy_max_words=30,
        copy_tokens=12,
        num_requests=3,
        min_output=4,
        max_output=8,
        max_num_seqs=4,
        max_model_len=256,
        disable_by_batch_size=8,
        output_dir=str(tmp_path / "out"),
    )
    result = run_speculative(opts, say=lambda _: None)
    (written,) = (tmp_path / "out").glob("speculative-*.json")
    assert json.loads(written.read_text())["copy"]["ratio"] == result["copy"]["ratio"]
    for key in ("copy", "throughput"):
        figures = result[key]
        assert figures["outputs_equal"] and figures["ratio"] > 0 and len(figures["runs"]) == 2
        assert [p["first"] for p in figures["runs"]] == ["off", "ngram"]  # alternating
        assert 0.0 <= figures["acceptance_rate"] <= 1.0
    assert result["copy"]["runs"][0]["off"]["output_tokens"] == 2 * 12
    assert result["disable_by_batch_size"] == 8


def test_the_cli_parses_the_options() -> None:
    args = parser_for("speculative", add_speculative_arguments).parse_args(
        ["--copy-tokens", "64", "--skip-throughput", "--threads", "1"]
    )
    opts = options_from(args)
    assert opts.copy_tokens == 64 and opts.skip_throughput and opts.threads == 1
    assert opts.speculative_config() == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    with pytest.raises(ValueError, match="nothing to run"):
        SpeculativeBenchOptions(skip_copy=True, skip_throughput=True)
