"""``python -m benchmarks.structured`` end to end on a tiny byte-level model: TPOT of both kinds at
each batch size with their ratio, and a trace whose slow compile overlaps running steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks._cli import parser_for
from benchmarks.structured import (
    StructuredBenchOptions,
    add_structured_arguments,
    big_schema,
    options_from,
    run_structured,
)
from loraplex.grammar import check
from loraplex.sampling_params import StructuredOutputsParams
from tests.utils.structured import byte_model, write_byte_tokenizer


def test_the_bench_writes_ratios_and_a_trace(tmp_path: Path) -> None:
    model_dir = byte_model(tmp_path / "m", seed=1)
    opts = StructuredBenchOptions(
        model=model_dir,
        batch_sizes=(1, 3),
        max_tokens=8,
        repeats=1,
        trace_batch=2,
        trace_tokens=30,
        slow_compile_seconds=0.3,
        max_model_len=512,
        output_dir=str(tmp_path / "out"),
    )
    result = run_structured(opts, say=lambda _: None)
    (written,) = (tmp_path / "out").glob("structured-*.json")
    assert json.loads(written.read_text())["tpot"].keys() == {"batch1", "batch3"}
    for figures in result["tpot"].values():
        assert figures["ratio"] > 0 and len(figures["runs"]) == 1
    summary = result["compile_trace"]["summary"]
    assert summary["steps_while_compiling"] >= 1
    assert summary["slow_request"]["finish_reason"] in ("stop", "length")
    states = [s["slow_request"] for s in result["compile_trace"]["steps"]]
    assert states.index("compiling") < len(states) - 1


def test_the_cli_parses_the_options() -> None:
    args = parser_for("structured", add_structured_arguments).parse_args(
        ["--batch-sizes", "1,8", "--threads", "1"]
    )
    opts = options_from(args)
    assert opts.batch_sizes == (1, 8) and opts.threads == 1
    with pytest.raises(ValueError, match="--batch-sizes"):
        options_from(
            parser_for("structured", add_structured_arguments).parse_args(["--batch-sizes", "x"])
        )


def test_the_trace_schema_is_one_the_backend_accepts(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_byte_tokenizer(tmp_path)
    check(StructuredOutputsParams(json=big_schema()), AutoTokenizer.from_pretrained(tmp_path))
