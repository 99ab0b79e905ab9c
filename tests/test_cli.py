from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loraplex.bench import systems
from loraplex.cli import main
from tests.utils.fakes import stats_from_flat
from tests.utils.models import english_tokenizer, make_tiny_model


@pytest.fixture(scope="module")
def english_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "llama"
    make_tiny_model(path, "llama")
    english_tokenizer(path)
    return str(path)


class StubLLM:
    """Stands in for ``loraplex.LLM``: fixed-length outputs, a simulated block prefix cache."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.block_size: int = kwargs["block_size"]
        self.caching: bool = kwargs["enable_prefix_caching"]
        self.cached: set[tuple[int, ...]] = set()
        self.stats = dict.fromkeys(systems.ENGINE_COUNTERS, 0)

    def generate(
        self, prompts: Sequence[list[int]], params: Sequence[Any], use_tqdm: bool = False
    ) -> list[Any]:
        outs = []
        for ids, p in zip(prompts, params, strict=True):
            bs, hit = self.block_size, 0
            while self.caching and hit + bs < len(ids) and tuple(ids[: hit + bs]) in self.cached:
                hit += bs
            for end in range(bs, len(ids) + 1, bs):
                self.cached.add(tuple(ids[:end]))
            self.stats["prefix_cache_queries"] += len(ids)
            self.stats["prefix_cache_hits"] += hit
            self.stats["num_prompt_tokens_computed"] += len(ids) - hit
            self.stats["num_generated_tokens"] += p.max_tokens
            time.sleep(1e-5 * (len(ids) - hit))
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=[3] * p.max_tokens)]))
        return outs

    def engine_stats(self) -> Any:
        return stats_from_flat(self.stats)

    def reset_prefix_cache(self) -> None:
        self.cached.clear()


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("loraplex: error: ")
    assert "Traceback" not in err
    return lines[0]


def test_serve_bad_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["serve", "--port", "eighty"], capsys)
    assert code == 2
    assert "invalid int value" in _one_error_line(err)


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        ([], 2, "required"),
        (["bench"], 2, "required"),
        (["bench", "throughput", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["bench", "throughput", "--num-requests", "0"], 2, "must be at least 1"),
        (["bench", "throughput", "--adapter-dist", "zipf"], 2, "invalid choice"),
        (["bench", "throughput", "--num-adapters", "-1"], 2, "must be 0 or more"),
        (["bench", "throughput", "--powerlaw-alpha", "-0.5"], 2, "must be 0 or more"),
        (["bench", "throughput", "--powerlaw-alpha", "nan"], 2, "must be 0 or more"),
        (["bench", "throughput", "--peft-mixed-batch-size", "0"], 2, "must be at least 1"),
        (
            ["bench", "throughput", "--num-adapters", "3", "--adapter-rank", "80"],
            1,
            "--max-lora-rank (64) must be at least --adapter-rank (80)",
        ),
        (["bench", "throughput", "--min-output", "9", "--max-output", "3"], 1, "--min-output"),
        (["bench", "throughput", "/no/such/model/dir"], 1, "not found"),
        (["bench", "throughput", "not-a-model"], 1, "not found"),
    ],
)
def test_failures_print_one_line(
    argv: list[str], code: int, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    got, _, err = _run(argv, capsys)
    assert got == code
    assert needle in _one_error_line(err)


def test_help_lists_the_benchmark_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["bench", "throughput", "--help"], capsys)
    assert code == 0
    flags = (
        "--hf-max-requests", "--prefix-cache-test", "--profile", "--num-adapters",
        "--adapter-dist", "--powerlaw-alpha", "--adapter-rank", "--max-loras", "--max-lora-rank",
        "--peft-mixed-batch-size",
    )  # fmt: skip
    for flag in flags:
        assert flag in out


def test_bench_throughput_end_to_end_with_stub_engine(
    english_tiny_model: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(systems, "build_llm", lambda d, a, **o: StubLLM(d, **a.kwargs(**o)))
    argv = [
        "bench", "throughput", english_tiny_model,
        "--num-requests", "6", "--min-output", "2", "--max-output", "5", "--repeats", "2",
        "--hf-batch-size", "2", "--hf-max-requests", "4",
        "--profile", "--profile-requests", "2",
        "--prefix-cache-test", "--prefix-len", "64", "--prefix-repeats", "2",
        "--output-dir", str(tmp_path),
    ]  # fmt: skip
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    [json_path] = tmp_path.glob("throughput-*.json")
    result = json.loads(json_path.read_text())
    lens = result["workload"]["output_lens"]
    assert len(lens) == 6 and all(2 <= n <= 5 for n in lens)

    runs = result["runs"]
    assert [r["system"] for r in runs] == ["loraplex", "hf", "hf", "loraplex"]  # alternating
    assert all(r["output_tokens"] == sum(lens) for r in runs if r["system"] == "loraplex")
    assert all(r["output_tokens"] == sum(lens[:4]) for r in runs if r["system"] == "hf")
    assert result["warnings"] == []

    summary = result["summary"]
    assert summary["hf"]["extrapolated"] is True and summary["hf"]["requests"] == 4
    lp, hf = summary["loraplex"], summary["hf"]
    assert summary["speedup"] == pytest.approx(
        lp["median_tokens_per_s"] / hf["median_tokens_per_s"], rel=1e-2
    )
    assert lp["prefix_cache_hit_tokens"] == [0, 0]  # repeats never reuse each other's KV
    assert 0 < lp["mfu"] == pytest.approx(lp["median_gflops"] / summary["peak_gflops"], rel=1e-3)

    pc = result["prefix_cache_test"]
    assert pc["only_unshared_computed"] is True
    assert all(r["hit_tokens"] == 64 for r in pc["caching_on"]["runs"])
    assert all(r["hit_tokens"] == 0 for r in pc["caching_off"]["runs"])
    assert Path(result["profile"]["table"]).is_file()

    assert "loraplex / HF throughput (ratio of medians)" in out
    reproduce = next(line for line in out.splitlines() if line.startswith("reproduce: "))
    assert reproduce.startswith("reproduce: loraplex bench throughput ")
    assert "--hf-max-requests=4" in reproduce and "--prefix-cache-test" in reproduce


@pytest.mark.slow
def test_bench_throughput_runs_the_real_engine(english_tiny_model: str, tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "loraplex.cli", "bench", "throughput", english_tiny_model,
        "--num-requests", "4", "--min-output", "2", "--max-output", "6", "--repeats", "1",
        "--hf-batch-size", "2", "--prefix-cache-test", "--prefix-len", "32",
        "--prefix-repeats", "1", "--output-dir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [json_path] = tmp_path.glob("throughput-*.json")
    result = json.loads(json_path.read_text())
    assert result["warnings"] == []
    assert result["summary"]["speedup"] > 0
    assert result["greedy_agreement_vs_hf"]["requests_compared"] == 4
    assert result["prefix_cache_test"]["only_unshared_computed"] is True
