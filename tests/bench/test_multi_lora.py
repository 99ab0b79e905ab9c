"""The multi-adapter mode of ``loraplex bench throughput``: adapter assignment, random adapters,
PEFT batch plans and counting, and a full mini-run of all four systems on a tiny model."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from loraplex.bench.adapters import (
    adapter_name,
    adapter_weights,
    assign_adapters,
    make_random_adapters,
    requests_per_adapter,
)
from loraplex.bench.common import ThroughputOptions
from loraplex.bench.flops import ModelShape, workload_flops
from loraplex.bench.multi_lora import run_order
from loraplex.bench.peft_baselines import (
    Batch,
    PeftBaselines,
    describe,
    mixed_plan,
    padding_efficiency,
    select_batches,
    static_plan,
)
from loraplex.bench.throughput import run_throughput
from tests.utils.models import english_tokenizer, make_tiny_model


@pytest.fixture(scope="module")
def tiny_with_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("multi-lora")
    model = make_tiny_model(root / "base", "llama", seed=5)
    english_tokenizer(Path(model))
    return model, make_random_adapters(model, root / "adapters", 3, rank=4, seed=1)


# ---- adapter assignment ---------------------------------------------------------------------


def test_uniform_assignment_is_flat_and_seeded() -> None:
    got = assign_adapters(20_000, 5, "uniform", seed=3)
    assert got == assign_adapters(20_000, 5, "uniform", seed=3)
    assert got != assign_adapters(20_000, 5, "uniform", seed=4)
    counts = requests_per_adapter(got, 5)
    assert sum(counts) == 20_000
    assert all(abs(c - 4_000) < 250 for c in counts)  # ~4 standard deviations


def test_powerlaw_assignment_follows_k_plus_1_to_minus_alpha() -> None:
    n = 8
    weights = adapter_weights(n, "powerlaw", alpha=1.0)
    harmonic = sum(1 / (k + 1) for k in range(n))
    assert weights == pytest.approx([1 / (k + 1) / harmonic for k in range(n)])
    got = Counter(assign_adapters(40_000, n, "powerlaw", alpha=1.0, seed=0))
    for k in range(n):
        assert got[k] / 40_000 == pytest.approx(weights[k], abs=0.01)
    assert got[0] > 2.5 * got[3]  # 1 : 1/4
    steeper = adapter_weights(n, "powerlaw", alpha=2.0)
    assert steeper[0] > weights[0] and steeper[-1] < weights[-1]
    assert adapter_weights(n, "powerlaw", alpha=0.0) == adapter_weights(n, "uniform")


def test_assignment_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_adapters"):
        adapter_weights(0, "uniform")
    with pytest.raises(ValueError, match="alpha"):
        adapter_weights(3, "powerlaw", alpha=-1.0)
    with pytest.raises(ValueError, match="zipf"):
        adapter_weights(3, "zipf")  # type: ignore[arg-type]


def test_run_order_alternates_and_keeps_neighbours() -> None:
    systems = ("loraplex", "loraplex_base", "peft_static", "peft_mixed")
    assert run_order(0, systems) == list(systems)  # type: ignore[arg-type]
    assert run_order(1, systems) == list(reversed(systems))  # type: ignore[arg-type]


def test_lora_flops_by_hand() -> None:
    shape = ModelShape(
        num_layers=2, hidden=8, intermediate=16, num_heads=2, num_kv_heads=1, head_dim=4, vocab=10
    )
    # per layer and rank: q (8+8) + k,v 2*(8+4) + o (8+8) + gate,up,down 3*(8+16) = 128
    assert shape.layer_lora_params_per_rank == 128
    base = workload_flops(shape, [3], [2])
    lora = workload_flops(shape, [3], [2], lora_rank=4)
    assert base["lora"] == 0
    assert lora["lora"] == 2 * 4 * 2 * 128 * 4  # 4 computed tokens
    assert lora["total"] - base["total"] == lora["lora"]


# ---- PEFT batch plans -----------------------------------------------------------------------

NAMES = ["a", "b", "a", "c", "a", "b", "a", "a", "c", "b"]
LENS = [5, 3, 8, 2, 4, 6, 1, 7, 3, 2]


def test_static_plan_groups_by_adapter_in_order() -> None:
    plan = static_plan(NAMES, 2)
    assert [(b.requests, b.adapters[0]) for b in plan] == [
        ((0, 2), "a"), ((4, 6), "a"), ((7,), "a"),
        ((1, 5), "b"), ((9,), "b"),
        ((3, 8), "c"),
    ]  # fmt: skip
    assert all(len(set(b.adapters)) == 1 for b in plan)
    assert sorted(i for b in plan for i in b.requests) == list(range(len(NAMES)))


def test_mixed_plan_keeps_workload_order() -> None:
    plan = mixed_plan(NAMES, 4)
    assert [b.requests for b in plan] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert plan[0].adapters == ("a", "b", "a", "c")


def test_select_batches_takes_whole_batches_round_robin_over_adapters() -> None:
    plan = static_plan(NAMES, 2)
    picked = select_batches(plan, 5, by_adapter=True)
    # visit order a0 (2), b0 (2), c0 (2: would make 6 > 5), a1, b1 (1: fits) ...
    assert [b.requests for b in picked] == [(0, 2), (1, 5), (9,)]
    assert describe(picked, LENS)["adapters_covered"] == 2
    picked = select_batches(plan, 6, by_adapter=True)
    assert [b.requests for b in picked] == [(0, 2), (1, 5), (3, 8)]  # one batch per adapter
    assert describe(picked, LENS)["adapters_covered"] == 3
    assert select_batches(plan, 1, by_adapter=True) == [plan[0]]  # at least one whole batch
    assert select_batches(plan, None, by_adapter=True) == plan
    assert select_batches(plan, 99, by_adapter=True) == plan
    mixed = mixed_plan(NAMES, 4)
    assert select_batches(mixed, 9, by_adapter=False) == mixed[:2]
    assert select_batches(mixed, 1, by_adapter=False) == mixed[:1]


def test_padding_efficiency_counts_rows_times_longest() -> None:
    batches = [Batch((0, 1), ("a", "b")), Batch((2,), ("a",))]
    # useful 5 + 3 + 8 = 16; decoded 2 rows * 5 steps + 1 * 8 = 18
    assert padding_efficiency(batches, LENS) == pytest.approx(16 / 18)
    assert batches[0].steps(LENS) == 5
    with pytest.raises(ValueError, match="one adapter name per request"):
        Batch((0, 1), ("a",))


# ---- adapters and PEFT on a tiny model ------------------------------------------------------


def test_random_adapters_are_seeded_and_scaled(
    tiny_with_adapters: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    model, dirs = tiny_with_adapters
    assert list(dirs) == [adapter_name(k) for k in range(3)]
    again = make_random_adapters(model, tmp_path, 1, rank=4, seed=1)
    first = load_file(Path(dirs[adapter_name(0)]) / "adapter_model.safetensors")
    assert load_file(Path(again[adapter_name(0)]) / "adapter_model.safetensors").keys() == (
        first.keys()
    )
    for key, t in load_file(Path(again[adapter_name(0)]) / "adapter_model.safetensors").items():
        assert torch.equal(t, first[key]), key
    other = load_file(Path(dirs[adapter_name(1)]) / "adapter_model.safetensors")
    assert not torch.equal(other[next(iter(other))], first[next(iter(first))])
    modules = {k.split(".")[-3] for k in first}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    config = json.loads((Path(dirs[adapter_name(0)]) / "adapter_config.json").read_text())
    assert config["r"] == 4


def test_peft_static_and_mixed_count_only_own_tokens(
    tiny_with_adapters: tuple[str, dict[str, str]],
) -> None:
    from loraplex.bench.systems import generate_padded

    model, dirs = tiny_with_adapters
    names = [adapter_name(k % 3) for k in range(6)]
    prompts = [[5 + i, 9, 17 + i, 30, 41 + 2 * i][: 2 + i % 4] for i in range(6)]
    lens = [3, 7, 2, 5, 4, 6]
    peft = PeftBaselines(model, "auto", dirs)
    static = peft.run("peft_static", static_plan(names, 2), prompts, lens, 0)
    mixed = peft.run("peft_mixed", mixed_plan(names, 4), prompts, lens, 0)
    for run in (static, mixed):
        assert run.output_tokens == sum(lens)
        assert sorted(run.indices) == list(range(6))
        assert [len(o) for o in run.outputs] == [lens[i] for i in run.indices]
    by_static = dict(zip(static.indices, static.outputs, strict=True))
    by_mixed = dict(zip(mixed.indices, mixed.outputs, strict=True))
    assert by_static == by_mixed  # same adapter per request, batched two ways
    with peft.model.disable_adapter():
        base = [
            generate_padded(peft.model, peft.pad_id, [p], n)[0]
            for p, n in zip(prompts, lens, strict=True)
        ]
    changed = sum(base[i] != by_static[i] for i in range(6))
    assert changed >= 4, "random adapters should change most greedy outputs"


# ---- all four systems, end to end -----------------------------------------------------------


def test_mini_run_of_all_four_systems(
    tiny_with_adapters: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    model, _ = tiny_with_adapters
    opts = ThroughputOptions(
        model=model,
        num_requests=8,
        min_output=2,
        max_output=6,
        repeats=2,
        num_adapters=3,
        adapter_dist="powerlaw",
        adapter_rank=4,
        max_loras=2,
        max_lora_rank=8,
        hf_batch_size=2,
        hf_max_requests=4,
        peft_mixed_batch_size=4,
        output_dir=str(tmp_path),
    )
    logged: list[str] = []
    result = run_throughput(opts, log=logged.append)
    [path] = tmp_path.glob("throughput-lora3-powerlaw-*.json")
    assert json.loads(path.read_text())["summary"] == result["summary"]
    lens = result["workload"]["output_lens"]

    order = [r["system"] for r in result["runs"]]
    forward = ["loraplex", "loraplex_base", "peft_static", "peft_mixed"]
    assert order == forward + forward[::-1]
    assert result["warnings"] == []
    for r in result["runs"]:
        if r["system"].startswith("loraplex"):
            assert r["num_requests"] == 8 and r["output_tokens"] == sum(lens)
        else:
            assert r["num_requests"] == 4  # whole batches: 2 x 2 or 1 x 4
    assert result["baselines"]["peft_static"]["timed"]["adapters_covered"] >= 2
    assert result["engine_lora"] == {"max_loras": 2, "max_cpu_loras": 3, "max_lora_rank": 8}

    s = result["summary"]
    per = s["systems"]
    assert set(per) == set(forward)
    assert per["peft_static"]["extrapolated"] and not per["loraplex"]["extrapolated"]
    best = max(("peft_static", "peft_mixed"), key=lambda k: per[k]["median_tokens_per_s"])
    assert s["best_peft"] == best
    assert s["speedup_vs_best_peft"] == pytest.approx(
        per["loraplex"]["median_tokens_per_s"] / per[best]["median_tokens_per_s"], rel=1e-2
    )
    assert s["lora_with_over_without"] == pytest.approx(
        per["loraplex"]["median_tokens_per_s"] / per["loraplex_base"]["median_tokens_per_s"],
        rel=1e-2,
    )
    assert len(s["per_repeat_lora_with_over_without"]) == 2
    assert s["median_paired_lora_with_over_without"] == pytest.approx(
        sum(s["per_repeat_lora_with_over_without"]) / 2, abs=1e-3
    )
    assert per["loraplex"]["prefix_cache_hits"] == [0, 0]  # repeats never reuse each other's KV
    assert result["flops"]["loraplex"]["lora"] > 0 == result["flops"]["loraplex_base"]["lora"]

    stats = result["engine_lora_stats"]
    assert stats["lora_registered"] == 3 and 1 <= stats["lora_resident_device"] <= 3
    # No --lora-memory: the engine's default pool, max_loras adapters at max_lora_rank (2 x 8
    # pages per module), in which each rank-4 adapter takes 4 pages per module.
    assert stats["lora_pool_pages"] == 7 * 2 * 8
    assert stats["lora_pool_pages_used"] == 7 * 4 * stats["lora_resident_device"]
    assert stats["lora_load_waits"] == 0
    assert len(result["adapters"]["content_hashes"]) == 3
    agree = result["greedy_agreement"]
    assert agree["loraplex_vs_peft_static"]["prefix_match_fraction"] >= 0.9
    assert agree["loraplex_vs_peft_mixed"]["prefix_match_fraction"] >= 0.9
    assert agree["loraplex_vs_loraplex_base"]["identical_fraction"] < 0.5
    assert any("PEFT baselines loaded" in line for line in logged)
