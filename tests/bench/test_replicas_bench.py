"""``python -m benchmarks.replicas`` end to end on a tiny model: 1 replica against 2 in paired runs,
and 4 adapters in a steady mix where affinity routing loads each on one replica and round robin
on more; the CLI parses its options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks._cli import parser_for
from benchmarks.replicas import (
    ReplicasBenchOptions,
    add_replicas_arguments,
    options_from,
    run_replicas,
    steady_mix,
)
from loraplex.engine.dp_client import usable_cpu_list
from tests.utils.models import english_tokenizer, make_tiny_model


@pytest.mark.skipif(len(usable_cpu_list()) < 2, reason="2 replicas need 2 CPUs")
def test_the_bench_writes_both_comparisons(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=2)
    english_tokenizer(Path(model_dir))
    opts = ReplicasBenchOptions(
        model=model_dir,
        num_requests=16,
        min_output=2,
        max_output=4,
        min_prompt_words=4,
        max_prompt_words=8,
        num_adapters=4,
        adapter_rank=4,
        repeats=2,
        output_dir=str(tmp_path / "out"),
    )
    result = run_replicas(opts, say=lambda _: None)
    (written,) = (tmp_path / "out").glob("replicas-*.json")
    assert json.loads(written.read_text())["throughput"]["ratio"] == result["throughput"]["ratio"]
    tp = result["throughput"]
    assert [p["first"] for p in tp["runs"]] == ["one", "many"]  # alternating
    assert tp["cores_many"] == 2 and tp["ratio"] > 0
    assert all(p["one"]["output_tokens"] == p["many"]["output_tokens"] for p in tp["runs"])
    ad = result["adapters"]
    for run in ad["runs"]:
        assert run["affinity"]["replicas_per_adapter"] == [1, 1, 1, 1]
        assert run["affinity"]["adapter_loads_per_replica"] == [2, 2]
        assert sum(run["round_robin"]["adapter_loads_per_replica"]) > 4
    assert (
        ad["adapter_loads_affinity"] == 4 and ad["adapters_on_more_than_one_replica_affinity"] == 0
    )


def test_the_cli_parses_the_options_and_the_mix_is_balanced() -> None:
    args = parser_for("replicas", add_replicas_arguments).parse_args(
        ["--num-requests", "8", "--repeats", "1"]
    )
    opts = options_from(args)
    assert opts.num_requests == 8 and opts.replicas == 2 and opts.num_adapters == 8
    assert "--num-requests=8" in opts.command_line()
    mix = steady_mix(24, 8, seed=0)
    assert sorted(mix[:8]) == list(range(8)) and sorted(mix[8:16]) == list(range(8))
    with pytest.raises(ValueError, match="leave nothing to run"):
        ReplicasBenchOptions(skip_throughput=True, skip_adapters=True)
