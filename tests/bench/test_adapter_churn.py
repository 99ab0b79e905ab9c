"""``python -m benchmarks.adapter_churn`` (issue 30): a few seconds of the bench on a tiny model through
a real ``loraplex serve``, with its engine process killed in the churn phase (the bench must
report the restart and the failed requests with the server's error codes); the random adapters
the server accepts (and their size at issue 30's rank 64); the acceptance checks; the flags.
No test asserts a timing."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from benchmarks.adapter_churn.options import ChurnOptions, add_churn_arguments, options_from
from benchmarks.adapter_churn.report import Sent, error_summary, summarize, ttft_summary
from benchmarks.adapter_churn.run import module_shapes, run_adapter_churn, write_adapter
from loraplex.bench.http_load import StreamRecord
from tests.utils.app import add_chat_template
from tests.utils.models import english_tokenizer, make_tiny_model

# SmolLM2-135M's geometry: what the embedded model's config.json says.
SMOLLM2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "intermediate_size": 1536, "num_hidden_layers": 30}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("churn") / "tiny", "llama", seed=3)
    english_tokenizer(Path(model_dir))
    add_chat_template(model_dir)
    return model_dir


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _kill_engine() -> None:
    """SIGKILL the engine process of the ``loraplex serve`` this test process started."""
    (server,) = [c for c in _children(os.getpid()) if "loraplex.cli serve" in _cmdline(c)]
    (engine,) = [c for c in _children(server) if "spawn_main" in _cmdline(c)]
    os.kill(engine, signal.SIGKILL)


@pytest.mark.timeout(240)
def test_a_short_run_reports_phases_a_killed_engine_and_a_png(
    tiny_model: str, tmp_path: Path
) -> None:
    opts = ChurnOptions.of_scenario(
        "b", model=tiny_model, num_adapters=5, rank=4, max_loras=2, max_cpu_loras=3,
        concurrency=4, duration_s=3.0, alone_s=1.5, warmup_s=1.0, b_interval_s=0.5,
        sample_s=0.5, output_dir=str(tmp_path),
    )  # fmt: skip
    lines: list[str] = []
    timers: list[threading.Timer] = []
    kill_failed: list[BaseException] = []

    def kill() -> None:
        try:
            _kill_engine()
        except Exception as exc:  # reported by the test, not lost in the timer's thread
            kill_failed.append(exc)

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("churn:"):  # the kill lands in B's window: warmup 1 s, then 0.5 s
            timers.append(threading.Timer(1.5, kill))
            timers[-1].start()

    result = run_adapter_churn(opts, log)
    for t in timers:
        t.join()
    assert len(timers) == 1 and not kill_failed, kill_failed
    (path,) = tmp_path.glob("adapter-churn-b-*.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    png = path.with_suffix(".png")
    if "matplotlib is not installed" not in lines[-1]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert result["server_args"][:3] == [tiny_model, "--max-loras", "2"]
    assert result["options"]["scenario"] == "b" and result["machine"]["cpu_model"]
    cold = result["cold_load"]
    assert cold["error"] is None and cold["cold_ttft_s"] > 0 and cold["warm_ttft_s"] > 0
    assert cold["counters"]["slot_loads"] >= 1  # the never-used adapter went to the device
    assert list(result["phases"]) == ["alone", "baseline", "churn"]
    for name, phase in result["phases"].items():
        assert set(phase["b_ttft"]) >= {"n", "sent", "p50_s", "p90_s", "p99_s"}
        assert phase["b_ttft"]["sent"] >= 2, name
        assert phase["engine"]["num_steps"] > 0 and "loads_deferred" in phase["engine"]
        assert set(phase["errors"]) == {"a", "b"}
        assert phase["engine_healthy_at_end"]
    alone, baseline, churn = result["phases"].values()
    assert alone["a"]["sent"] == 0 and baseline["a"]["completed"] > 0
    for phase in (alone, baseline):  # no kill, one adapter at most for A: nothing to report
        assert phase["engine"]["engine_restarts"] == 0
        assert phase["errors"]["a"]["count"] == phase["errors"]["b"]["count"] == 0
    assert baseline["engine"]["slot_evictions"] == 0

    assert churn["engine"]["engine_restarts"] >= 1
    assert churn["engine"]["slot_loads"] > 0  # 5 adapters through 2 slots
    errors = churn["errors"]["a"]
    assert errors["count"] == churn["a"]["failed"] > 0
    assert sum(errors["by_code"].values()) == errors["count"]
    # a stream cut by the kill carries the server's error event, not a silent end
    assert "incomplete_stream" not in errors["by_code"], errors
    assert all(e["message"] and e["status"] in (200, 503) for e in errors["first"])
    assert churn["engine_down_reasons"], "the sampler saw the engine down"
    assert churn["counters_over_time"]["engine_restarts"][-1] >= 1
    summary = result["summary"]
    assert summary["engine_restarts"] >= 1 and not summary["met"]["no_engine_restarts"]
    assert summary["errors"]["a"] >= errors["count"]
    assert "b_p90_churn_over_baseline" in summary  # None when no B request got through
    assert result["server_log_problems"]["count"] > 0  # the server logged the death


def test_random_adapters_fit_the_model_and_weigh_7_mb_at_rank_64(
    tiny_model: str, tmp_path: Path
) -> None:
    from transformers import AutoConfig

    from loraplex.lora.adapter import BaseModelInfo, load_adapter

    out = write_adapter(tiny_model, tmp_path / "tiny-r4", 4, ("q_proj", "v_proj"), seed=1)
    base = BaseModelInfo.from_hf_config(AutoConfig.from_pretrained(tiny_model))
    adapter = load_adapter(out, base, max_rank=8)  # the server's own checks
    assert adapter.rank == 4 and set(adapter.target_modules) == {"q_proj", "v_proj"}
    (tmp_path / "smol").mkdir()
    (tmp_path / "smol" / "config.json").write_text(json.dumps(SMOLLM2))
    layers, shapes = module_shapes(str(tmp_path / "smol"))
    assert layers == 30 and shapes["q_proj"] == (576, 576) and shapes["v_proj"] == (576, 192)
    big = write_adapter(str(tmp_path / "smol"), tmp_path / "r64", 64, ("q_proj", "v_proj"), 0)
    size = (big / "adapter_model.safetensors").stat().st_size
    assert 7.0e6 < size < 7.6e6  # issue 30's "7 MB adapter": rank 64 on q and v, fp16


def _sent(status: int = 200, tokens: int = 16, error: str | None = None,
          code: str | None = None, ttft: float | None = 0.1) -> Sent:  # fmt: skip
    record = StreamRecord("a", sent=0.0, status=status, tokens=tokens, error=error,
                          error_code=code, first=ttft)  # fmt: skip
    return Sent(record, "a-0", 16)


def test_a_request_completes_only_with_all_its_tokens_and_no_error() -> None:
    ok, cut = _sent(), _sent(tokens=5)
    event = _sent(tokens=5, error="the engine process died", code="engine_unavailable")
    refused = _sent(status=503, tokens=0, error="restarting", code="engine_unavailable", ttft=None)
    assert ok.ok and not cut.ok and not event.ok and not refused.ok
    assert cut.problem()["code"] == "incomplete_stream"
    assert "after 5 of 16 tokens" in cut.problem()["message"]
    summary = error_summary([ok, cut, event, refused, refused])
    assert summary["count"] == 4
    assert summary["by_code"] == {"engine_unavailable": 3, "incomplete_stream": 1}
    assert [(e["status"], e["code"], e["count"]) for e in summary["first"]] == [
        (200, "incomplete_stream", 1), (200, "engine_unavailable", 1),
        (503, "engine_unavailable", 2),
    ]  # fmt: skip
    ttft = ttft_summary([ok, _sent(ttft=0.3), event])
    assert (ttft["n"], ttft["completed"], ttft["sent"]) == (2, 2, 3)
    assert ttft["p50_s"] == pytest.approx(0.2)


def _phase(p90: float, restarts: int = 0, a_errors: int = 0, deferred: int = 5) -> dict[str, Any]:
    errors = {"count": a_errors, "by_code": {}, "first": []}
    return {
        "b_ttft": {"p90_s": p90},
        "a": {"failed": a_errors},
        "errors": {"a": errors, "b": {"count": 0, "by_code": {}, "first": []}},
        "engine": {"engine_restarts": restarts, "loads_deferred": deferred, "num_steps": 100},
    }


def test_the_summary_checks_issue_30s_acceptance() -> None:
    cold = {"extra_ttft_s": 0.4, "errors": {"a": {"count": 0}, "b": {"count": 0}}}
    good = summarize(cold, {"alone": _phase(0.1), "baseline": _phase(0.2),
                            "churn": _phase(0.39)})  # fmt: skip
    assert good["b_p90_churn_over_baseline"] == pytest.approx(1.95)
    assert all(good["met"].values()), good["met"]
    bad = summarize(
        {"extra_ttft_s": 1.5, "errors": {"a": {"count": 0}, "b": {"count": 1}}},
        {"baseline": _phase(0.2), "churn": _phase(0.5, restarts=2, a_errors=3, deferred=101)},
    )
    assert bad["engine_restarts"] == 2 and bad["errors"] == {"a": 3, "b": 1}
    assert not any(bad["met"].values()), bad["met"]


def _parse(*argv: str) -> ChurnOptions:
    p = argparse.ArgumentParser()
    add_churn_arguments(p)
    return options_from(p.parse_args(list(argv)))


def test_scenarios_set_the_issues_values_and_flags_win() -> None:
    a = _parse()
    assert (a.num_adapters, a.rank, a.concurrency, a.b_interval_s) == (5, 64, 5, 0.0)
    assert a.serve_args() == ["--log-level", "warning"]  # the default server
    b = _parse("--scenario", "b", "--duration-s", "300", "--policy", "fcfs")
    assert (b.num_adapters, b.rank, b.concurrency, b.b_interval_s) == (40, 8, 16, 2.0)
    assert b.duration_s == 300.0
    assert b.serve_args() == ["--scheduling-policy", "fcfs", "--max-loras", "4",
                              "--max-lora-rank", "8", "--max-cpu-loras", "8",
                              "--max-num-seqs", "16", "--log-level", "warning"]  # fmt: skip
    assert "--scenario=b" in b.command_line() and "--max-loras=4" in b.command_line()
    assert _parse("--scenario", "b", "--max-loras", "8").max_loras == 8


def test_bad_options_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="above --max-lora-rank 8"):
        ChurnOptions.of_scenario("b", rank=16)
    with pytest.raises(ValueError, match="--target-modules takes modules from"):
        ChurnOptions(target_modules=("lm_head",))
    with pytest.raises(ValueError, match="--concurrency must be at least 1"):
        ChurnOptions(concurrency=0)
    with pytest.raises(SystemExit):
        _parse("--policy", "lifo")
