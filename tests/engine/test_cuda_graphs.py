"""The decode CUDA-graph runner's bookkeeping on the CPU, with each "graph" replaced by direct
calls of the same captured function (``DirectCalls``) and the Triton kernels interpreted: bucket
choice, static-buffer refresh, padding rows to the bucket (pads never write KV nor get sampled),
and a replay after the adapters changed using the new ones."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loraplex.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.attention.base import BatchLayout
from loraplex.engine.cuda_graphs import (
    DecodeGraphRunner,
    DirectCalls,
    Forward,
    ManagerLoRA,
    bucket_for,
    build_decode_graphs,
    decode_buckets,
)
from loraplex.engine.records import RunnerOutput, ScheduledRequest, SchedulerOutput
from loraplex.engine.runner import ModelRunner
from loraplex.kernels.kv_write import PAD_SLOT
from loraplex.kernels.meta import LoRAKernelMeta
from loraplex.sampling_params import SamplingParams
from tests.utils.lora_plan import Planner
from tests.utils.models import make_adapter, make_tiny_model

triton = pytest.importorskip("triton")
BLOCK = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=64, logprobs=3)


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("graphs") / "llama"
    return make_tiny_model(path, "llama", seed=4, hidden_size=32, intermediate_size=64)


def test_buckets() -> None:
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert decode_buckets(3) == (1, 2, 3)
    assert decode_buckets(1) == (1,)
    buckets = decode_buckets(40)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 17, 33, 40, 41)] == [
        1, 2, 4, 8, 8, 16, 24, 40, 40, None,
    ]  # fmt: skip


def test_no_graphs_off_cuda_or_when_eager(model_dir: str) -> None:
    runner = make_runner(model_dir)
    assert runner.graphs is None  # the CPU never captures
    cuda = torch.device("cuda")
    args = (runner.model, runner.attn, None, 8, 64, BLOCK)
    assert build_decode_graphs(*args, cuda, True) is None  # type: ignore[arg-type]
    torch_runner = make_runner(model_dir, backend="torch")
    assert build_decode_graphs(torch_runner.model, torch_runner.attn, None, 8, 64, BLOCK, cuda,
                               False) is None  # fmt: skip


def make_runner(
    model_dir: str, backend: str = "triton", lora: LoRAConfig | None = None
) -> ModelRunner:
    runner = ModelRunner(
        ModelConfig(max_model_len=64, attention_backend=backend),  # type: ignore[arg-type]
        CacheConfig(block_size=BLOCK, num_blocks=40),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        model_dir,
        lora,
    )
    runner.init_kv_cache()
    return runner


def with_graphs(runner: ModelRunner) -> DirectCalls:
    calls = DirectCalls()
    assert runner.kv_cache is not None
    runner.graphs = DecodeGraphRunner(
        runner.model,
        runner.attn,  # type: ignore[arg-type]
        8,
        runner.max_model_len,
        BLOCK,
        runner.device,
        calls,
        None if runner.lora is None else ManagerLoRA(runner.lora),
    )
    return calls


@dataclass
class Seq:
    rid: str
    tokens: list[int]
    table: list[int]
    computed: int = 0
    slot: int = -1
    out: list[int] = field(default_factory=list)


def step_of(seqs: list[Seq], lora_slots: dict[int, str] | None = None) -> SchedulerOutput:
    reqs = [
        ScheduledRequest(
            s.rid, s.tokens[s.computed :], s.computed, s.table, True, PARAMS, s.tokens, s.out,
            s.slot,
        )
        for s in seqs
    ]  # fmt: skip
    return SchedulerOutput(reqs, lora_slots=lora_slots or {})


def advance(seqs: list[Seq], res: RunnerOutput) -> None:
    for s in seqs:
        s.computed = len(s.tokens)
        s.tokens.append(res.sampled[s.rid][0])


def assert_same(a: RunnerOutput, b: RunnerOutput) -> None:
    """The same tokens, and the same top logprobs within float noise."""
    assert a.sampled == b.sampled
    assert a.logprobs.keys() == b.logprobs.keys()
    for rid, lps in a.logprobs.items():
        for x, y in zip(lps, b.logprobs[rid], strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            np.testing.assert_allclose([v for _, v in x.top], [v for _, v in y.top], atol=1e-5)


def top_logprobs(res: RunnerOutput) -> list[float]:
    return [v for rid in sorted(res.logprobs) for lp in res.logprobs[rid] for _, v in lp.top]


def make_seqs(n: int, first_block: int = 1) -> list[Seq]:
    rng = np.random.default_rng(n)
    seqs = []
    for i in range(n):
        blocks = [first_block + 4 * i + j for j in range(4)]  # 16 slots each, disjoint
        prompt = rng.integers(3, 500, size=int(rng.integers(2, 7))).tolist()  # a prefill
        seqs.append(Seq(f"r{i}", prompt, blocks))
    return seqs


def test_decode_through_graphs_matches_eager(model_dir: str) -> None:
    eager, graphed = make_runner(model_dir), make_runner(model_dir)
    calls = with_graphs(graphed)
    graphs = graphed.graphs
    assert graphs is not None
    addresses = {name: t.data_ptr() for name, t in graphs.buffers()}
    seqs_e, seqs_g = make_seqs(5), make_seqs(5)

    # a prefill step is not a decode step: eager on both
    res_e, res_g = eager.execute(step_of(seqs_e[:3])), graphed.execute(step_of(seqs_g[:3]))
    assert calls.captures == 0
    assert_same(res_g, res_e)
    advance(seqs_e[:3], res_e)
    advance(seqs_g[:3], res_g)

    for k in range(3):  # 3 decodes -> bucket 4 (one pad row); every bucket captured at the first
        res_e, res_g = eager.execute(step_of(seqs_e[:3])), graphed.execute(step_of(seqs_g[:3]))
        assert_same(res_g, res_e)
        assert set(res_g.sampled) == {"r0", "r1", "r2"}  # the pad row is never sampled
        advance(seqs_e[:3], res_e)
        advance(seqs_g[:3], res_g)
        assert graphs.captured == (1, 2, 4, 8) and calls.captures == 4 and calls.replays == k + 1
        # the pad row: no KV write, one key of the null block, nothing for LoRA
        assert graphs.slot_mapping[3] == PAD_SLOT and graphs.seq_lens[3] == 1
        assert graphs.block_tables[3].abs().sum() == 0 and graphs.input_ids[3] == 0
        assert graphs.seq_lens[:3].tolist() == [len(s.tokens) - 1 for s in seqs_g[:3]]

    # two more requests join (eager prefill), then 5 decodes -> bucket 8
    res_e, res_g = eager.execute(step_of(seqs_e[3:])), graphed.execute(step_of(seqs_g[3:]))
    advance(seqs_e[3:], res_e)
    advance(seqs_g[3:], res_g)
    for _ in range(2):
        res_e, res_g = eager.execute(step_of(seqs_e)), graphed.execute(step_of(seqs_g))
        assert_same(res_g, res_e)
        advance(seqs_e, res_e)
        advance(seqs_g, res_g)
    assert calls.captures == 4 and calls.replays == 5  # bucket 8, no new capture
    assert graphs.slot_mapping[5:8].tolist() == [PAD_SLOT] * 3
    # a smaller batch again reuses bucket 4: rows 3.. of the buffers are pads once more
    res_e, res_g = eager.execute(step_of(seqs_e[1:4])), graphed.execute(step_of(seqs_g[1:4]))
    assert_same(res_g, res_e)
    assert calls.captures == 4 and graphs.slot_mapping[3] == PAD_SLOT
    assert {name: t.data_ptr() for name, t in graphs.buffers()} == addresses
    assert eager.kv_cache is not None and graphed.kv_cache is not None
    torch.testing.assert_close(graphed.kv_cache, eager.kv_cache, atol=1e-5, rtol=1e-5)
    assert graphed.kv_cache[:, :, 0].abs().sum() == 0  # pad rows never wrote the null block


def test_graphs_refuse_what_they_cannot_run(model_dir: str) -> None:
    runner = make_runner(model_dir)
    with_graphs(runner)
    graphs = runner.graphs
    assert graphs is not None
    tables = np.ones((2, 3), dtype=np.int64)
    decode = BatchLayout(np.array([1, 1]), np.array([4, 7]), tables, torch.tensor([5, 6]), BLOCK)
    chunk = BatchLayout(np.array([1, 2]), np.array([4, 7]), tables, torch.tensor([5, 6, 7]), BLOCK)
    wide = BatchLayout(
        np.array([1]), np.array([4]), np.ones((1, 17), dtype=np.int64), torch.tensor([5]), BLOCK
    )
    many = BatchLayout(np.ones(9, dtype=np.int64), np.full(9, 3), np.ones((9, 1), np.int64),
                       torch.arange(9), BLOCK)  # fmt: skip
    assert graphs.can_run(decode)
    assert not graphs.can_run(chunk)  # a prefill chunk in the step
    assert not graphs.can_run(wide)  # tables wider than max_model_len needs
    assert not graphs.can_run(many)  # more rows than the largest bucket
    with pytest.raises(ValueError, match="not a decode step"):
        graphs.refresh(torch.zeros(2, dtype=torch.long), torch.zeros(3), chunk, np.zeros(2))


def test_a_replay_after_the_adapters_changed_uses_the_new_ones(
    model_dir: str, tmp_path: Path
) -> None:
    lora_cfg = LoRAConfig(max_loras=2, max_cpu_loras=4, max_lora_rank=8)
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    paths = [make_adapter(model_dir, tmp_path / f"a{i}", 8, 16, targets, seed=i) for i in range(2)]
    eager, graphed = make_runner(model_dir, lora=lora_cfg), make_runner(model_dir, lora=lora_cfg)
    calls = with_graphs(graphed)
    keys = []
    planners = {id(r): Planner(r) for r in (eager, graphed)}
    for runner in (eager, graphed):
        keys = [planners[id(runner)].add(p, f"a{i}") for i, p in enumerate(paths)]
    a, b = keys
    seqs_e, seqs_g = make_seqs(3), make_seqs(3)

    def both(slots: list[int], lora_slots: dict[int, str]) -> tuple[RunnerOutput, RunnerOutput]:
        for s_e, s_g, slot in zip(seqs_e, seqs_g, slots, strict=True):
            s_e.slot = s_g.slot = slot
        res_e = eager.execute(planners[id(eager)].plan(step_of(seqs_e, lora_slots)))
        res_g = graphed.execute(planners[id(graphed)].plan(step_of(seqs_g, lora_slots)))
        assert_same(res_g, res_e)
        advance(seqs_e, res_e)
        advance(seqs_g, res_g)
        return res_e, res_g

    both([0, -1, 0], {0: a})  # prefill with adapter a (eager; allocates the stacks)
    both([0, -1, 0], {0: a})  # decode: every bucket captured, then a replay with slot 0 = a
    assert calls.captures == 4
    # slot 0 now holds adapter b (the same slot index, new weights), then a mix in two slots
    both([0, -1, 0], {0: b})
    both([1, 0, -1], {0: b, 1: a})
    # no adapter at all: the graph's LoRA kernels see empty segments (base model everywhere)
    both([-1, -1, -1], {})
    assert calls.captures == 4 and calls.replays == 4
    assert graphed.graphs is not None and graphed.graphs.lora is not None
    meta = graphed.graphs.lora.meta
    assert not meta.has_lora and meta.active_slots.tolist() == [-1, -1]
    # the adapters do change the outputs here, so a stale adapter would have been caught above
    probe = [Seq("p", [5, 9, 13], [37, 38], computed=2)]
    outs = []
    for slot, lora_slots in ((-1, {}), (0, {0: a}), (0, {0: b})):
        probe[0].slot = slot
        step = planners[id(graphed)].plan(step_of(probe, lora_slots))
        outs.append(top_logprobs(graphed.execute(step)))
    assert outs[0] != outs[1] != outs[2] != outs[0]


def test_graphs_wait_for_the_adapter_stacks(model_dir: str) -> None:
    # a graph captured before the LoRA layers have their weights would hold no LoRA kernels
    unbound = SimpleNamespace(
        meta=LoRAKernelMeta(8, 2), step=None, layers=[(0, SimpleNamespace(weights=None))]
    )
    bound = SimpleNamespace(
        meta=unbound.meta, step=None, layers=[(0, SimpleNamespace(weights=object()))]
    )
    assert not ManagerLoRA(unbound).ready()  # type: ignore[arg-type]
    assert ManagerLoRA(bound).ready()  # type: ignore[arg-type]
    runner = make_runner(model_dir)
    calls = DirectCalls()
    graphs = DecodeGraphRunner(
        runner.model, runner.attn, 8, runner.max_model_len, BLOCK, runner.device, calls,  # type: ignore[arg-type]
        ManagerLoRA(unbound),  # type: ignore[arg-type]
    )  # fmt: skip
    decode = BatchLayout(np.array([1]), np.array([4]), np.ones((1, 2), np.int64),
                         torch.tensor([5]), BLOCK)  # fmt: skip
    assert not graphs.can_run(decode)
    graphs.lora = ManagerLoRA(bound)  # type: ignore[arg-type]
    assert graphs.can_run(decode)
    assert calls.captures == 0


class FailingCapture(DirectCalls):
    def capture(self, fn: Forward) -> Forward:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_falls_back_to_eager(
    model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    eager, graphed = make_runner(model_dir), make_runner(model_dir)
    with_graphs(graphed)
    assert graphed.graphs is not None
    graphed.graphs._capture = FailingCapture()
    seqs_e, seqs_g = make_seqs(2), make_seqs(2)
    for _ in range(3):  # a prefill, then decodes: the first decode tries to capture and fails
        res_e, res_g = eager.execute(step_of(seqs_e)), graphed.execute(step_of(seqs_g))
        assert_same(res_g, res_e)
        advance(seqs_e, res_e)
        advance(seqs_g, res_g)
    assert graphed.graphs.disabled is not None and "stream is capturing" in graphed.graphs.disabled
    assert graphed.graphs.captured == ()
    assert "CUDA graph capture failed" in caplog.text
