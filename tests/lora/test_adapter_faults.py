"""Faults of one adapter's load stay with that adapter (issue 30): the file missing, changed,
truncated, corrupt, with another content hash, unreadable, NaN or Inf weights, no room in the pool,
an exception in the copy thread. In each, a base-model request and another tenant's adapter
request run in the same batches as the faulty adapter's request: those two get exactly the
tokens of a run without the fault, the faulty one ends with finish reason "error" and a reason
that names the adapter, and the engine keeps stepping (the step never raises)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.core import EngineCore
from loraplex.engine.records import EngineCoreOutput
from loraplex.engine.request import Request
from loraplex.engine.scheduler import ADAPTER_FAILED
from loraplex.llm import LLM
from loraplex.lora.manager import LoRAManager
from loraplex.sampling_params import SamplingParams
from tests.utils.models import make_adapter, make_tiny_model

WEIGHTS = "adapter_model.safetensors"
P = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    root = tmp_path_factory.mktemp("faults")
    model_dir = make_tiny_model(root / "base", "llama", seed=3)
    good = make_adapter(model_dir, root / "good", 4, 8, ["q_proj", "v_proj"], seed=1)
    bad = make_adapter(model_dir, root / "bad", 4, 8, ["q_proj", "v_proj"], seed=2)
    return model_dir, good, bad


def run(
    env: tuple[str, str, str],
    tmp: Path,
    fault: Callable[[Path], None] | None,
    **engine_args: object,
) -> tuple[dict[str, EngineCoreOutput], dict[str, list[int]], EngineCore]:
    """Add both adapters (the faulty one first, so that it leaves host memory and is read
    from disk again), apply ``fault`` to the faulty adapter's directory, run the three
    requests together; the last output and the tokens of each."""
    model_dir, good, bad = env
    bad_dir = tmp / "bad"
    shutil.copytree(bad, bad_dir)
    args: dict[str, object] = {"max_loras": 2, "max_cpu_loras": 1, "max_model_len": 64}
    core = LLM(model_dir, **(args | engine_args)).llm_engine.core  # type: ignore[arg-type]
    bad_key = core.add_lora("z/bad@1", str(bad_dir)).content_hash
    good_key = core.add_lora("y/good@1", good).content_hash
    if fault is not None:
        fault(bad_dir)
    reqs = [
        Request("base", [5, 6, 7], P, tenant="x"),
        Request("good", [5, 6, 7], P, lora_key=good_key, tenant="y"),
        Request("bad", [5, 6, 7], P, lora_key=bad_key, tenant="z"),
    ]
    for r in reqs:
        core.add_request(r)
    last: dict[str, EngineCoreOutput] = {}
    steps = 0
    while core.has_unfinished_requests():
        steps += 1
        assert steps < 500, "the engine stopped making progress"
        for out in core.step():
            last[out.request_id] = out
    return last, {r.request_id: list(r.output_token_ids) for r in reqs}, core


@pytest.fixture(scope="module")
def clean(
    env: tuple[str, str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[int]]:
    last, tokens, _ = run(env, tmp_path_factory.mktemp("clean"), None)
    assert all(o.finish_reason == "length" for o in last.values())
    return tokens


def missing(d: Path) -> None:
    shutil.rmtree(d)


def changed(d: Path) -> None:  # a valid adapter, other content: the scaling changed
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["lora_alpha"] = cfg["lora_alpha"] * 2
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def other_hash(d: Path) -> None:  # valid weights, other values
    w = load_file(str(d / WEIGHTS))
    save_file({k: v + 0.5 for k, v in w.items()}, str(d / WEIGHTS))


def truncated(d: Path) -> None:
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(data[: len(data) // 2])


def corrupt(d: Path) -> None:
    data = bytearray((d / WEIGHTS).read_bytes())
    data[:16] = b"\xff" * 16  # the header's length and its first bytes
    (d / WEIGHTS).write_bytes(bytes(data))


def unreadable(d: Path) -> None:  # root reads any mode: a directory where the file was
    (d / WEIGHTS).unlink()
    (d / WEIGHTS).mkdir()


def nan_weights(d: Path) -> None:
    w = load_file(str(d / WEIGHTS))
    name = next(k for k in w if "lora_B" in k)
    w[name] = torch.full_like(w[name], float("nan"))
    save_file(w, str(d / WEIGHTS))


def inf_weights(d: Path) -> None:  # one entry of an A matrix: the check must look at every one
    w = load_file(str(d / WEIGHTS))
    name = next(k for k in w if "lora_A" in k)
    w[name][0, -1] = float("-inf")
    save_file(w, str(d / WEIGHTS))


FAULTS = {
    "missing": (missing, "its files are missing"),
    "changed": (changed, "its files changed on disk"),
    "other_hash": (other_hash, "its files changed on disk"),
    "truncated": (truncated, "its stored files are damaged"),
    "corrupt": (corrupt, "its stored files are damaged"),
    "unreadable": (unreadable, "could not be loaded: its files"),
    "nan_weights": (nan_weights, "NaN or Inf"),
    "inf_weights": (inf_weights, "NaN or Inf"),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_faulty_adapter_file_fails_its_requests_alone(
    name: str, env: tuple[str, str, str], tmp_path: Path, clean: dict[str, list[int]]
) -> None:
    fault, reason = FAULTS[name]
    last, tokens, core = run(env, tmp_path, fault)
    bad = last["bad"]
    assert bad.finish_reason == "error" and bad.error_code == ADAPTER_FAILED
    assert bad.error is not None and "adapter 'z/bad@1'" in bad.error and reason in bad.error
    assert str(tmp_path) not in bad.error  # no server paths for the client
    assert tokens["base"] == clean["base"] and tokens["good"] == clean["good"]
    assert tokens["bad"] == []
    stats = core.stats().lora
    assert (
        stats is not None
        and stats.load_failures == 1
        and list(stats.failed.values()) == [bad.error]
    )
    # the failure sticks: a new request on it ends at once, without another load
    key = next(iter(stats.failed))
    core.add_request(Request("again", [5], P, lora_key=key, tenant="z"))
    outs = core.step()
    assert [o.error_code for o in outs if o.request_id == "again"] == [ADAPTER_FAILED]
    assert core.stats().lora.load_failures == 1  # type: ignore[union-attr]


def test_an_exception_in_the_copy_thread_fails_that_adapter_alone(
    env: tuple[str, str, str],
    tmp_path: Path,
    clean: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fill = LoRAManager._fill

    def failing_fill(self: LoRAManager, adapter, pages, pin):  # type: ignore[no-untyped-def]
        if adapter.name == "z/bad@1":
            raise RuntimeError("device copy failed")
        fill(self, adapter, pages, pin)

    monkeypatch.setattr(LoRAManager, "_fill", failing_fill)
    last, tokens, _ = run(env, tmp_path, None)
    assert last["bad"].error_code == ADAPTER_FAILED
    assert "the copy into the adapter pool failed (RuntimeError)" in (last["bad"].error or "")
    assert tokens["base"] == clean["base"] and tokens["good"] == clean["good"]


def test_no_room_in_a_pool_full_of_pinned_adapters_fails_that_adapter_alone(
    env: tuple[str, str, str], tmp_path: Path, clean: dict[str, list[int]]
) -> None:
    model_dir, good, bad = env
    probe = LLM(model_dir, max_model_len=64).llm_engine.core.runner.lora
    assert probe is not None and probe.geometry is not None
    page_set = sum(probe.geometry.page_bytes.values())
    # 12 pages a module: two pinned rank-4 adapters hold 8 for good; the good rank-4 adapter
    # fits in the other 4, the rank-8 one never can
    core = LLM(
        model_dir, max_loras=2, max_model_len=64, max_lora_rank=8, lora_memory=12 * page_set
    ).llm_engine.core
    pinned = make_adapter(model_dir, tmp_path / "pinned", 4, 8, ["q_proj", "v_proj"], seed=5)
    core.add_lora("ops/pinned@1", pinned, pinned=True)
    core.add_lora("ops/pinned2@1", bad, pinned=True)
    good_key = core.add_lora("y/good@1", good).content_hash
    big = make_adapter(model_dir, tmp_path / "big", 8, 16, ["q_proj", "v_proj"], seed=6)
    big_key = core.add_lora("z/big@1", big).content_hash
    reqs = [
        Request("base", [5, 6, 7], P, tenant="x"),
        Request("good", [5, 6, 7], P, lora_key=good_key, tenant="y"),
        Request("big", [5, 6, 7], P, lora_key=big_key, tenant="z"),
    ]
    for r in reqs:
        core.add_request(r)
    last: dict[str, EngineCoreOutput] = {}
    for _ in range(200):
        for out in core.step():
            last[out.request_id] = out
        if not core.has_unfinished_requests():
            break
    assert last["big"].error_code == ADAPTER_FAILED
    assert "'z/big@1'" in (last["big"].error or "")
    assert "full of pinned adapters" in (last["big"].error or "")
    assert reqs[0].output_token_ids == clean["base"]
    assert reqs[1].output_token_ids == clean["good"]
