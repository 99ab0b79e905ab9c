"""benchmarks.serve_vs_vllm's vLLM side, against a stand-in for vLLM's CLI (``vllm serve`` and
``vllm bench serve``): what the server is started with, what the client is run with, and the
run's figures read back from the client's result file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from benchmarks.serve_vs_vllm import NAME, run_one
from tests.utils.health_stub import HEALTH_SERVER

# vllm.entrypoints.cli.main: `serve` answers /health; `bench serve` writes its result file.
STUB_MAIN = (
    HEALTH_SERVER
    + """
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["STUB_VLLM_RECORD"], "a") as f:
    f.write(json.dumps(argv) + "\\n")
def flag(name):
    return argv[argv.index(name) + 1]
if argv[0] == "serve":
    serve_health(int(flag("--port")))
elif argv[:2] == ["bench", "serve"] and "--save-result" in argv:
    result = {"output_throughput": 123.456, "median_ttft_ms": 10.04, "p99_ttft_ms": 20.06,
              "median_tpot_ms": 3.333, "completed": 64}
    with open(os.path.join(flag("--result-dir"), flag("--result-filename")), "w") as f:
        json.dump(result, f)
"""
)


@pytest.fixture
def stub_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "stub"
    cli = root / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for pkg in (root / "vllm", root / "vllm" / "entrypoints", cli):
        (pkg / "__init__.py").write_text("")
    (cli / "main.py").write_text(STUB_MAIN)
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("STUB_VLLM_RECORD", str(record))
    return record


def test_a_vllm_run_starts_its_server_runs_its_client_and_reads_the_result(
    stub_vllm: Path, tmp_path: Path
) -> None:
    args = argparse.Namespace(vllm_python=sys.executable, vllm_dtype="bfloat16",
                              loraplex_platform=False)  # fmt: skip
    loras = {"a0": "/adapters/a0", "a1": "/adapters/a1"}
    run = run_one("vllm", args, "/models/base", loras, tmp_path, "vllm-0")
    assert run["system"] == "vllm" and run["output_tokens_per_s"] == 123.46
    assert (run["ttft_median_ms"], run["ttft_p99_ms"], run["tpot_median_ms"]) == (10.0, 20.1, 3.33)
    assert run["completed"] == 64

    serve, warm, bench = [json.loads(line) for line in stub_vllm.read_text().splitlines()]
    assert serve[:2] == ["serve", "/models/base"]
    assert serve[serve.index("--dtype") + 1] == "bfloat16"
    assert serve[serve.index("--served-model-name") + 1] == NAME
    assert serve[serve.index("--max-loras") + 1] == "2"
    assert serve[serve.index("--lora-modules") + 1 :][:2] == ["a0=/adapters/a0", "a1=/adapters/a1"]
    for client in (warm, bench):
        assert client[:2] == ["bench", "serve"] and "--ignore-eos" in client
        assert client[client.index("--lora-assignment") + 1] == "round-robin"
    assert warm[warm.index("--num-prompts", warm.index("--num-prompts") + 1) + 1] == "8"
    assert "--save-result" in bench and "--save-result" not in warm
