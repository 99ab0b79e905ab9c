"""``python -m benchmarks.contention`` (issue 20): a mini run on a tiny model with two adapters, a busy
process and a stub vLLM beside loraplex; the children's environments and protocol; the busy
processes always ending; the options' one-line errors. No test asserts a timing."""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks._cli import parser_for
from benchmarks.contention.__main__ import main
from benchmarks.contention.options import ContentionOptions, add_contention_arguments, options_from
from benchmarks.contention.procs import (
    Child,
    ChildError,
    busy_processes,
    frozen,
    is_running,
    loraplex_env,
    vllm_env,
)
from benchmarks.contention.run import build_spec, run_contention, run_order, vllm_argv, vllm_script
from benchmarks.contention.worker import StepTimer, percentile, step_stats, timed_run, tree_pids
from benchmarks.vllm_dtype import resolve_vllm_dtype
from loraplex.cpu_threads import SPIN_ENV
from tests.utils.models import english_tokenizer, make_tiny_model

# A stand-in for vLLM's offline API: records what it is given, one step() per output token.
STUB_VLLM = """
import json, os
__version__ = "0.0-stub"

def _record(obj):
    with open(os.environ["STUB_VLLM_RECORD"], "a") as f:
        f.write(json.dumps(obj) + "\\n")

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class _Engine:
    def step(self):
        return []

class _Completion:
    def __init__(self, ids):
        self.token_ids = ids

class _Output:
    def __init__(self, ids):
        self.outputs = [_Completion(ids)]

class LLM:
    def __init__(self, **kw):
        _record({"init": kw})
        self.llm_engine = _Engine()

    def generate(self, prompts, params, use_tqdm=True, lora_request=None):
        loras = lora_request or [None] * len(prompts)
        _record({"generate": {
            "prompts": prompts, "params": [p.kw for p in params], "use_tqdm": use_tqdm,
            "lora": [None if r is None else [r.lora_name, r.lora_int_id, r.lora_path]
                     for r in loras],
        }})
        for _ in range(max(p.kw["max_tokens"] for p in params)):
            self.llm_engine.step()
        return [_Output(list(range(p.kw["max_tokens"]))) for p in params]

    def reset_prefix_cache(self):
        _record({"reset": True})
        return True
"""
STUB_LORA_REQUEST = """
class LoRARequest:
    def __init__(self, lora_name, lora_int_id, lora_path):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path
"""


def _stub_vllm(root: Path) -> Path:
    pkg = root / "vllm"
    (pkg / "lora").mkdir(parents=True)
    (pkg / "__init__.py").write_text(STUB_VLLM)
    (pkg / "lora" / "__init__.py").write_text("")
    (pkg / "lora" / "request.py").write_text(STUB_LORA_REQUEST)
    return root


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- a mini run ------------------------------------------------------------------------------


def test_mini_run_beside_a_busy_process_and_a_stub_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_tiny_model(tmp_path / "base", "llama", seed=5)
    english_tokenizer(Path(model))
    stub = _stub_vllm(tmp_path / "stub")
    record = tmp_path / "vllm-calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("STUB_VLLM_RECORD", str(record))
    monkeypatch.setenv("GOMP_SPINCOUNT", "777")  # the parent's own setting never reaches a child
    opts = ContentionOptions(
        model=model,
        busy=(0, 1),
        spincounts=("1000",),
        repeats=2,
        num_requests=3,
        min_output=2,
        max_output=5,
        num_adapters=2,
        adapter_rank=2,
        batch1_tokens=6,
        batch1_words=12,
        copy_mb=4,
        vllm_python=sys.executable,
        timeout_s=120,
        output_dir=str(tmp_path / "out"),
    )
    result = run_contention(opts, log=lambda line: None)

    [json_path] = (tmp_path / "out").glob("contention-*.json")
    [md_path] = (tmp_path / "out").glob("contention-*.md")
    saved = json.loads(json_path.read_text())
    assert saved["complete"] and saved["summary"] == result["summary"]
    for key in ("command", "options", "machine", "workload", "children", "bandwidth_probes"):
        assert key in saved
    assert md_path.read_text().startswith("# python -m benchmarks.contention")

    # The run order: per repeat the busy counts, and within each the systems, alternate.
    got = [(r["scenario"], r["repeat"], r["busy"], r["system"]) for r in result["runs"]]
    assert got == run_order(opts, ["loraplex", "vllm"])
    assert got[:8] == [
        ("workload", 0, 0, "loraplex"), ("workload", 0, 0, "vllm"),
        ("workload", 0, 1, "loraplex"), ("workload", 0, 1, "vllm"),
        ("workload", 1, 1, "vllm"), ("workload", 1, 1, "loraplex"),
        ("workload", 1, 0, "vllm"), ("workload", 1, 0, "loraplex"),
    ]  # fmt: skip
    for run in result["runs"]:
        assert run["output_tokens"] == run["expected_tokens"]
        assert len(run["busy_pids"]) == run["busy"] and run["busy_ran_throughout"]
        assert run["steps"]["count"] >= max(result["workload"][run["scenario"]]["output_lens"])
        assert run["idle_children_cpu_s"] >= 0
    assert result["warnings"] == []

    # Every process this run started has ended: the children and the busy processes.
    pids = [c["pid"] for c in result["children"]] + [
        pid for run in result["runs"] for pid in run["busy_pids"]
    ]  # two children; one busy process in each busy run of each system, scenario and repeat
    assert len(pids) == 2 + 2 * 2 * 2 and not [pid for pid in pids if is_running(pid)]

    # Each child read its own wait policy; vLLM keeps its runtime's defaults.
    children = {c["system"]: c for c in result["children"]}
    assert children["loraplex"]["env"]["GOMP_SPINCOUNT"] == "1000"
    assert children["loraplex"]["env"][SPIN_ENV] == "1000"
    assert children["vllm"]["env"]["GOMP_SPINCOUNT"] is None
    assert children["vllm"]["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model)
    assert children["loraplex"]["weight_bytes"] == 4 * sum(p.numel() for p in hf.parameters())

    # vLLM got the same token ids, output lengths and adapters as loraplex.
    calls = _records(record)
    assert calls[0]["init"] == {
        "model": model, "dtype": resolve_vllm_dtype("auto")[0], "seed": 0,
        "enable_lora": True, "max_loras": 2, "max_lora_rank": 2,
    }  # fmt: skip
    timed = [c["generate"] for c in calls if "generate" in c][1:]  # after the warm-up
    workload = result["workload"]["workload"]
    first = timed[0]
    assert [len(p["prompt_token_ids"]) for p in first["prompts"]] == workload["prompt_tokens"]
    assert [p["max_tokens"] for p in first["params"]] == workload["output_lens"]
    assert all(p["ignore_eos"] and p["temperature"] == 0.0 for p in first["params"])
    assert [lora[1] for lora in first["lora"]] == [1, 2, 1]  # request i on adapter i % 2
    assert first["use_tqdm"] is False

    summary = result["summary"]
    cell = summary["by_scenario"]["workload"]["1000"]
    assert len(cell["loraplex"]["1"]["vs_quiet"]["per_repeat"]) == 2
    assert len(cell["loraplex_over_vllm"]["0"]["per_repeat"]) == 2
    batch1 = summary["by_scenario"]["batch1"]["1000"]["loraplex"]["0"]
    assert batch1["median_decode_tokens_per_s"] > 0 and batch1["decode_of_bound"] > 0
    bound = summary["bandwidth_bound"]
    assert bound["weight_bytes_per_token"] == children["loraplex"]["weight_bytes"]
    assert len(result["bandwidth_probes"]) == 2
    whats = {c["what"] for c in summary["checks"]}
    assert "loraplex busy=1 / quiet, worst pair" in whats
    assert "loraplex / vLLM quiet (adapters), median pair" in whats
    assert "loraplex batch-1 decode / bandwidth bound, quiet" in whats
    assert summary["loraplex_outputs_identical_across_runs"] == {"workload": True, "batch1": True}


def test_a_python_without_vllm_fails_in_one_line(
    tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [tiny_llama, "--vllm-python", sys.executable]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()  # progress lines, then the error
    [line] = [ln for ln in lines if "error" in ln]
    assert line == lines[-1]
    assert line.startswith(
        "python -m benchmarks.contention: error: ChildError: vllm: ModuleNotFoundError: No module"
    )
    [log] = tmp_path.glob("contention-*-vllm.log")  # kept beside the results, named in the line
    assert str(log) in line and "Traceback" in log.read_text()


# ---- the parts -------------------------------------------------------------------------------


def test_without_vllm_python_only_loraplex_runs() -> None:
    opts = ContentionOptions(busy=(0, 2), repeats=2, scenarios=("batch1",))
    assert opts.vllm_python is None and opts.paired_busy == (2,)
    assert run_order(opts, ["loraplex"]) == [
        ("batch1", 0, 0, "loraplex"), ("batch1", 0, 2, "loraplex"),
        ("batch1", 1, 2, "loraplex"), ("batch1", 1, 0, "loraplex"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="no --vllm-python"):
        vllm_argv(opts, Path("w.py"), Path("s.json"))
    assert "--vllm-python" not in opts.command_line()


def test_the_vllm_child_is_a_standalone_script(tmp_path: Path) -> None:
    script = vllm_script(tmp_path)
    opts = ContentionOptions(vllm_python=sys.executable)
    assert vllm_argv(opts, script, tmp_path / "spec.json") == [
        sys.executable, str(script), str(tmp_path / "spec.json"),
    ]  # fmt: skip
    tree = ast.parse(script.read_text())
    imported = {
        (node.module or "" if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported - set(sys.stdlib_module_names) == {"vllm", "torch"}  # no loraplex
    # vLLM's LLM is built only through main(), under the __main__ guard (spawned workers
    # re-import the script).
    *body, guard = tree.body
    loose = [n for n in body if not isinstance(n, ast.FunctionDef | ast.ClassDef)]
    assert not [c for n in loose for c in ast.walk(n) if isinstance(c, ast.Call)]
    assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "__name__ == '__main__'"


def test_build_spec_gives_each_scenario_token_ids_lengths_and_adapters() -> None:
    def tokenizer(text: str) -> SimpleNamespace:  # word lengths as token ids
        return SimpleNamespace(input_ids=[len(w) for w in text.split()])

    opts = ContentionOptions(num_requests=5, num_adapters=2, adapter_rank=4, batch1_tokens=9)
    spec = build_spec(opts, "/m", tokenizer, {"a0": "/p0", "a1": "/p1"})
    work, one = spec["scenarios"]["workload"], spec["scenarios"]["batch1"]
    assert work["adapters"] == [0, 1, 0, 1, 0] and len(work["prompts"]) == 5
    assert one["output_lens"] == [9] and one["adapters"] == [None]
    assert spec["loraplex_engine"] == {"max_loras": 2, "max_lora_rank": 4}
    assert spec["warm"]["adapters"] == [None] * 4 + [0, 1]
    assert spec["adapters"] == [{"name": "a0", "path": "/p0"}, {"name": "a1", "path": "/p1"}]
    base = build_spec(ContentionOptions(num_requests=2), "/m", tokenizer, {})
    assert base["loraplex_engine"] == {} and base["scenarios"]["workload"]["adapters"] == [None] * 2


def test_child_environments() -> None:
    base = {"GOMP_SPINCOUNT": "10000", "OMP_WAIT_POLICY": "active", SPIN_ENV: "5", "HOME": "/h"}
    env = loraplex_env("1000", base, SPIN_ENV)
    assert env[SPIN_ENV] == "1000" and "GOMP_SPINCOUNT" not in env and env["HOME"] == "/h"
    assert "OMP_WAIT_POLICY" not in env and env["PYTHONPATH"]
    passive = loraplex_env("passive", base, SPIN_ENV)
    assert passive["OMP_WAIT_POLICY"] == "passive" and SPIN_ENV not in passive
    assert loraplex_env("default", base, SPIN_ENV)[SPIN_ENV] == "default"
    engine = loraplex_env("engine", base, SPIN_ENV)  # loraplex's own choice
    assert not {SPIN_ENV, "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & engine.keys()
    v = vllm_env(base, SPIN_ENV, 2)
    assert "GOMP_SPINCOUNT" not in v and SPIN_ENV not in v and v["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_busy_processes_end_however_the_block_ends() -> None:
    with pytest.raises(RuntimeError, match="stop"), busy_processes(2) as procs:
        pids = [p.pid for p in procs]
        assert all(is_running(pid) for pid in pids)
        raise RuntimeError("stop")
    assert not [pid for pid in pids if is_running(pid)]
    with busy_processes(0) as none:
        assert none == []


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_an_idle_child_and_its_children_are_stopped_for_a_run_and_continued_after() -> None:
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('up', flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "up"
        tree = sorted(tree_pids(parent.pid))
        assert len(tree) == 2  # the child and its own child (vLLM's engine core is one)
        with pytest.raises(RuntimeError, match="run failed"), frozen([parent.pid]):
            assert [_state(pid) for pid in tree] == ["T", "T"]
            raise RuntimeError("run failed")  # continued however the block ends
        assert "T" not in [_state(pid) for pid in tree]
    finally:
        for pid in sorted(tree_pids(parent.pid), reverse=True):
            os.kill(pid, 9)
        parent.wait()


def test_busy_processes_die_with_a_killed_benchmark() -> None:
    code = (
        "import time\n"
        "from benchmarks.contention.procs import busy_processes\n"
        "with busy_processes(1) as procs:\n"
        "    print(procs[0].pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert bench.stdout is not None
    pid = int(bench.stdout.readline())
    assert is_running(pid)
    bench.kill()  # SIGKILL: no finally block runs
    bench.wait()
    deadline = time.monotonic() + 10
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_running(pid)


def test_a_failing_child_is_one_line_naming_its_last_words(tmp_path: Path) -> None:
    code = "import sys; print('loading...'); print('no such model', file=sys.stderr); sys.exit(3)"
    child = Child("vllm", [sys.executable, "-c", code], os.environ, tmp_path / "c.log", 30)
    with pytest.raises(ChildError, match=r"^vllm exited \(code 3\): no such model$"):
        child.expect("ready")
    child.close()
    assert (tmp_path / "c.log.stdout").read_text() == "loading...\n"  # kept apart
    kept = child.keep_log(tmp_path / "kept.log").read_text()
    assert kept.startswith("no such model") and kept.endswith("loading...\n")


def test_step_timing_and_the_batch1_decode_rate() -> None:
    class Engine:
        def step(self) -> int:
            return 1

    class Backend:
        stepper = Engine()

        def info(self) -> dict[str, Any]:
            return {}

        def generate(self, prompts: Any, lens: list[int], adapters: Any) -> list[list[int]]:
            return [[0] * n for n in lens if [self.stepper.step() for _ in range(n + 1)]]

        def reset_prefix_cache(self) -> None:
            pass

    backend = Backend()
    timer = StepTimer(backend.stepper)
    backend.stepper.step()  # outside a run: not recorded
    run = timed_run(backend, timer, {"prompts": [[1]], "output_lens": [4], "adapters": [None]})
    assert run["output_tokens"] == run["expected_tokens"] == 4
    assert run["steps"]["count"] == 5 and timer.times and not timer.on
    assert run["decode_tokens_per_s"] > 0  # from the last 3 steps
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0
    assert step_stats([]) is None
    assert step_stats([0.001, 0.003])["p50_ms"] == 2.0  # type: ignore[index]


# ---- options ---------------------------------------------------------------------------------


def _options(argv: list[str]) -> ContentionOptions:
    return options_from(parser_for("contention", add_contention_arguments).parse_args(argv))


def test_defaults_and_the_reproduce_line() -> None:
    opts = _options([])
    assert opts.busy == (0, 1) and opts.spincounts == ("default", "1000", "10000", "100000")
    assert opts.scenarios == ("workload", "batch1") and opts.repeats == 2
    assert (opts.num_requests, opts.min_output, opts.max_output, opts.seed) == (64, 16, 128, 0)
    assert opts.batch1_tokens == 192 and opts.num_adapters == 0
    other = _options(
        ["--busy", "0,2", "--spincounts", "passive,500,engine", "--num-adapters", "8", "--chat",
         "--vllm-python", sys.executable, "--threads", "1"]
    )  # fmt: skip
    again = _options(shlex.split(other.command_line())[3:])
    assert again == other


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (["--busy", "1,2"], 1, "--busy must include 0"),
        (["--busy", "0,1,1"], 1, "--busy: distinct counts of 0 or more"),
        (["--busy", "0,x"], 2, "expected whole numbers separated by commas"),
        (["--spincounts", "1000,10k"], 1, "--spincounts: whole numbers, 'engine', 'default' or"),
        (["--spincounts", "1000,1000"], 1, "--spincounts: a setting is repeated"),
        (
            ["--scenarios", "workload,chat"],
            1,
            "--scenarios: choose from workload, batch1; got chat",
        ),
        (["--vllm-python", "/no/such/python"], 1, "--vllm-python /no/such/python: no executable"),
        (["--num-adapters", "300"], 1, "--num-adapters must be in [0, 256]"),
        (["--batch1-tokens", "1"], 1, "--batch1-tokens must be at least 2"),
        (["--repeats", "0"], 2, "must be at least 1"),
        (["--min-output", "9", "--max-output", "3"], 1, "need 1 <= --min-output <= --max-output"),
    ],
)
def test_bad_options_fail_in_one_line(
    argv: list[str], code: int, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m benchmarks.contention: error: ")
    assert needle in lines[0]
