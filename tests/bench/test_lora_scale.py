"""The adapters-at-scale sweep of ``loraplex bench throughput`` (issue 15): its options, the pool
and weight-traffic arithmetic, and two mini runs on a tiny model (a sweep over mixed ranks whose
pool holds every adapter, and a power-law workload over a pool that holds half of them)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from loraplex.bench.adapter_options import adapter_options_from
from loraplex.bench.adapters import adapter_ranks, assign_adapters
from loraplex.bench.common import ThroughputOptions
from loraplex.bench.flops import ModelShape
from loraplex.bench.lora_scale import weight_traffic
from loraplex.bench.pool_sizing import pool_plan
from loraplex.bench.throughput import run_throughput
from loraplex.cli import build_parser, main
from tests.utils.models import english_tokenizer, make_tiny_model

SMOLLM2_135M = ModelShape(
    num_layers=30, hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64,
    vocab=49152,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    model = make_tiny_model(tmp_path_factory.mktemp("lora-scale") / "base", "llama", seed=5)
    english_tokenizer(Path(model))
    return model


# ---- options --------------------------------------------------------------------------------


def _options(argv: list[str]) -> ThroughputOptions:
    from loraplex.bench.systems import BENCH_KNOBS, EngineArgs

    args = build_parser().parse_args(["bench", "throughput", *argv])
    engine = EngineArgs({k: v for k in BENCH_KNOBS if (v := getattr(args, k)) is not None})
    return ThroughputOptions(**adapter_options_from(args), engine=engine)


def test_a_list_of_adapter_counts_is_a_sweep_without_peft() -> None:
    opts = _options(["--num-adapters", "1,2,4", "--adapter-ranks", "4,8,16,64"])
    assert opts.counts == (1, 2, 4) and opts.num_adapters == 0
    assert opts.run_systems == ("loraplex", "loraplex_base")
    assert opts.dist == "roundrobin" and opts.ranks == (4, 8, 16, 64)
    assert opts.registered == 4
    one = _options(["--num-adapters", "8"])
    assert one.counts == (8,) and one.adapter_counts == ()
    assert one.with_peft and one.dist == "uniform"  # the four-system PEFT comparison, as before
    assert _options(["--num-adapters", "8", "--systems", "loraplex,loraplex_base"]).dist == (
        "roundrobin"
    )
    pool = _options(["--num-adapters", "256", "--pool-adapters", "64"])
    assert pool.pool_adapters == 64 and pool.lora_memory is None and pool.max_loras is None
    assert _options(["--num-adapters", "2", "--lora-memory", "0.25"]).lora_memory == 0.25
    assert _options(["--num-adapters", "2", "--lora-memory", "625MB"]).lora_memory == 625_000_000


def test_the_reproduce_line_parses_back_to_the_same_run() -> None:
    def view(o: ThroughputOptions) -> tuple[object, ...]:
        return (o.counts, o.run_systems, o.dist, o.powerlaw_alpha, o.ranks, o.registered,
                o.max_loras, o.max_cpu_loras, o.lora_memory, o.pool_adapters,
                o.engine.lora_dtype)  # fmt: skip

    for argv in (
        ["--num-adapters", "256", "--adapter-dist", "powerlaw", "--pool-adapters", "64",
         "--adapter-ranks", "4,8", "--max-cpu-loras", "300"],
        ["--num-adapters", "1,2", "--lora-memory", "2GiB", "--max-loras", "2"],
        ["--num-adapters", "32,64", "--lora-dtype", "float16"],
        ["--skip-hf", "--tensor-parallel-size", "2", "--enforce-eager", "--num-blocks", "64"],
    ):  # fmt: skip
        opts = _options(argv)
        again = _options(shlex.split(opts.command_line())[3:])
        assert view(again) == view(opts)
        assert again.engine.config == opts.engine.config  # every engine knob the bench takes
        assert again.command_line() == opts.command_line()


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (["--num-adapters", "1,x"], 2, "expected integers such as 8 or 1,2,4"),
        (["--num-adapters", "2,2"], 2, "a value is repeated in '2,2'"),
        (["--num-adapters", "0,2"], 2, "must be 0 or more"),
        (["--systems", "loraplex,vllm"], 2, "unknown system vllm"),
        (["--adapter-ranks", "4,0"], 2, "expected ranks of 1 or more"),
        (["--lora-memory", "12parsecs"], 2, "unknown unit"),
        (["--lora-memory", "1MB", "--pool-adapters", "2"], 2, "not allowed with"),
        (
            ["--num-adapters", "1,2", "--systems", "loraplex,peft_mixed"],
            1,
            "PEFT baselines (peft_mixed) run with one --num-adapters value",
        ),
        (["--num-adapters", "4", "--num-registered", "2"], 1, "--num-registered (2) must be"),
        (["--num-adapters", "4", "--pool-adapters", "9"], 1, "--pool-adapters must be in [1, 4]"),
        (["--adapter-ranks", "4,8"], 1, "--adapter-ranks need --num-adapters"),
        (
            ["--num-adapters", "2", "--adapter-ranks", "4,128"],
            1,
            "--max-lora-rank (64) must be at least the largest of --adapter-ranks (128)",
        ),
        (["--num-adapters", "2", "--systems", "loraplex_base"], 1, "must include loraplex"),
        (["--num-adapters", "300", "--max-loras", "300"], 1, "--max-loras must be in [1, 256]"),
    ],
)
def test_bad_options_fail_in_one_line(
    argv: list[str], code: int, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "throughput", *argv]) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loraplex: error: ")
    assert needle in lines[0]


# ---- assignment, pool and traffic arithmetic ------------------------------------------------


def test_roundrobin_and_rank_cycles() -> None:
    assert assign_adapters(7, 3, "roundrobin", seed=9) == [0, 1, 2, 0, 1, 2, 0]
    assert adapter_ranks(5, (4, 8)) == [4, 8, 4, 8, 4]
    assert adapter_ranks(2, 16) == [16, 16]
    with pytest.raises(ValueError, match="at least 1"):
        adapter_ranks(2, (4, 0))


def test_64_rank_8_adapters_of_the_embedded_model_are_625_mb() -> None:
    one = SMOLLM2_135M.lora_bytes(8, 4)
    assert one == 8 * 30 * 10_176 * 4  # per layer, per rank: sum of (in + out) = 10,176
    assert 64 * one == 625_213_440
    assert SMOLLM2_135M.decode_weight_bytes(4) == (30 * 3_538_944 + 576 * 49152) * 4


def test_pool_plan_holds_the_adapters_it_is_sized_for() -> None:
    sizes = [10, 20, 10, 20]
    assert pool_plan(ThroughputOptions(num_adapters=3), 3, sizes) == (40, 3)
    assert pool_plan(ThroughputOptions(num_adapters=4, pool_adapters=2), 4, sizes) == (30, 2)
    assert pool_plan(ThroughputOptions(num_adapters=4, lora_memory=35), 4, sizes) == (35, 2)
    assert pool_plan(ThroughputOptions(num_adapters=4, lora_memory=0.5), 4, sizes) == (0.5, 4)


def test_weight_traffic_counts_each_distinct_adapter_of_a_step_once() -> None:
    shape = ModelShape(
        num_layers=2, hidden=8, intermediate=16, num_heads=2, num_kv_heads=1, head_dim=4, vocab=10
    )
    base = shape.decode_weight_bytes(4)
    # decode step 1 runs requests 0, 1, 3 (adapters 0, 0, 1); step 2 runs request 0 only
    got = weight_traffic(shape, [0, 0, 1, 1], [3, 2, 1, 2], [100, 30], 4)
    assert got["base_weight_bytes_per_step"] == base
    assert got["adapters_per_step_max"] == 2 and got["adapters_per_step_mean"] == 1.5
    assert got["adapter_bytes_per_step_max"] == 130
    assert got["adapter_bytes_per_step_mean"] == 115
    assert got["ratio_if_bandwidth_bound"] == round(base / (base + 115), 3)


# ---- mini runs ------------------------------------------------------------------------------


def test_mini_sweep_over_mixed_ranks(tiny_model: str, tmp_path: Path) -> None:
    opts = ThroughputOptions(
        model=tiny_model,
        num_requests=4,
        min_output=2,
        max_output=4,
        repeats=2,
        adapter_counts=(1, 2),
        adapter_ranks=(2, 4),
        max_lora_rank=8,
        output_dir=str(tmp_path),
    )
    result = run_throughput(opts, log=lambda line: None)
    [path] = tmp_path.glob("throughput-lora-scale-1-2-roundrobin-*.json")
    saved = json.loads(path.read_text())  # written after N=1, then complete
    assert saved["table"] == result["table"] and saved["complete"]
    [md] = tmp_path.glob("throughput-lora-scale-1-2-roundrobin-*.md")
    rows = md.read_text().splitlines()
    assert rows[0].startswith("| N | tok/s with | tok/s base | ratio |") and "used/real" in rows[0]
    assert rows[2].startswith("| 1 |") and rows[3].startswith("| 2 |")

    real = result["adapters"]["real_bytes"]
    assert result["adapters"]["ranks"] == [2, 4] and real[1] == 2 * real[0]
    lens = result["workload"]["output_lens"]
    for point, n in zip(result["points"], (1, 2), strict=True):
        assert point["assignment"] == [i % n for i in range(4)]
        assert [r["system"] for r in point["runs"]] == [
            "loraplex", "loraplex_base", "loraplex_base", "loraplex",
        ]  # fmt: skip
        assert all(r["output_tokens"] == sum(lens) for r in point["runs"])
        assert point["engine_lora"]["max_loras"] == n
        assert point["engine_lora"]["lora_memory"] == sum(real[:n])
        pool = point["pool"]
        # The pool is exactly the N adapters' real size and they fill it, page for page.
        assert pool["pool_bytes"] == pool["pool_bytes_used"] == pool["adapter_bytes"]
        assert pool["adapter_bytes"] == sum(real[:n]) and pool["used_over_real"] == 1.0
        assert pool["resident_device"] == n
        assert point["timed"]["load_waits"] == 0 and point["timed"]["slot_loads"] == 0
        assert point["failures"] == 0
        s = point["summary"]
        with_, base = (
            s["systems"][k]["median_tokens_per_s"] for k in ("loraplex", "loraplex_base")
        )
        assert s["ratio"] == pytest.approx(with_ / base, rel=1e-2)
        assert len(s["per_repeat_ratio"]) == 2
        assert point["weight_traffic"]["adapters_per_step_max"] == n
    assert len(set(result["adapters"]["content_hashes"].values())) == 2
    assert result["warnings"] == []


def test_mini_power_law_over_a_pool_of_half_the_adapters(tiny_model: str, tmp_path: Path) -> None:
    opts = ThroughputOptions(
        model=tiny_model,
        num_requests=6,
        min_output=2,
        max_output=4,
        repeats=1,
        num_adapters=4,
        adapter_dist="powerlaw",
        pool_adapters=2,
        adapter_rank=2,
        max_lora_rank=8,
        skip_hf=True,
        output_dir=str(tmp_path),
    )
    result = run_throughput(opts, log=lambda line: None)
    [point] = result["points"]
    used = set(point["assignment"])
    assert used - {0, 1}, "the seeded draw must need adapters the pool does not start with"
    real = result["adapters"]["real_bytes"]
    assert point["engine_lora"] == {
        "max_loras": 2, "max_cpu_loras": 4, "max_lora_rank": 8, "lora_memory": real[0] + real[1],
    }  # fmt: skip
    assert point["pool"]["pool_bytes"] == real[0] + real[1]
    assert point["pool"]["resident_device"] <= 2
    timed = point["timed"]
    # the timed runs start from the pool the untimed run left (not adapters 0 and 1): they load
    # and evict at least once, wherever they start
    assert timed["slot_loads"] >= 1 and timed["slot_evictions"] >= 1
    assert timed["load_waits"] == 0 and point["failures"] == 0
    lens = result["workload"]["output_lens"]
    assert all(r["output_tokens"] == sum(lens) for r in point["runs"])
    assert result["table"][0]["load_waits"] == 0
