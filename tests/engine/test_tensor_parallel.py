"""Tensor parallelism over gloo on this machine: ``tensor_parallel_size=2`` gives the tokens
``tensor_parallel_size=1`` gives, greedy, token for token, on tiny Llama and Qwen3 models with
base and adapter requests mixed in one batch; a dead worker fails the engine with a clear error
(no hang), and no worker outlives the engine.

fp32 sums run in another order with two ranks (each rank's partial, then the all-reduce), so a
near-tie between the two best tokens could flip. The test demands equal tokens, and that the
tp=2 logprobs of the best two tokens at every step are within ``LOGPROB_TOL`` of tp=1's; it
first checks that every tp=1 choice wins by more than twice that (``MIN_MARGIN``; the chosen
seeds give it), so a flip could only come from a real difference, never from float noise. The models cover an odd vocabulary (padded vocabulary shards), an untied and a tied LM
head, grouped KV heads split between the ranks, and one KV head replicated on both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.tensor_parallel import TensorParallelError
from loraplex.llm import LLM
from tests.utils.models import make_adapter, make_tiny_model

LOGPROB_TOL = 1e-4  # float noise between tp=1 and tp=2 (measured: below 1e-5)
MIN_MARGIN = 2 * LOGPROB_TOL  # logprob gap between the chosen token and the next, every step
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODELS: dict[str, dict[str, Any]] = {
    # odd vocabulary (shards padded), untied head, 2 KV heads: one per rank
    "llama": dict(vocab_size=509, num_key_value_heads=2, tie_word_embeddings=False),
    # tied head, one KV head replicated on both ranks
    "qwen3": dict(num_key_value_heads=1, tie_word_embeddings=True),
}
PROMPTS = [
    [5, 77, 301, 12, 9],
    [400, 3, 3, 81, 250, 18, 44, 7, 99, 120, 4],
    [33, 66, 99],
    [210, 211, 212, 213, 214, 215, 216, 217, 218],
    [7, 8],
    [480, 11, 150, 151],
]
ADAPTER_OF = [None, "a4", "a8", None, "a8", "a4"]  # base and two adapters, mixed
MAX_TOKENS = 6
KNOBS: dict[str, Any] = dict(dtype="float32", max_model_len=64, max_loras=2, block_size=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict[str, str]]]:
    """arch -> (model dir, adapter name -> dir), built once for the module."""
    out = {}
    for i, (arch, overrides) in enumerate(MODELS.items()):
        root = tmp_path_factory.mktemp(f"tp-{arch}")
        model_dir = make_tiny_model(root / "base", arch, seed=20 + i, **overrides)
        adapters = {
            "a4": make_adapter(model_dir, root / "a4", 4, 8, ["q_proj", "v_proj", "down_proj"], 1),
            "a8": make_adapter(model_dir, root / "a8", 8, 16, ALL, 2),
        }
        out[arch] = (model_dir, adapters)
    return out


def greedy(
    llm: LLM, adapters: dict[str, str], use_adapters: bool = True
) -> list[list[tuple[int, float, int, float]]]:
    """Per prompt, per token: (token, its logprob, the runner-up, its logprob)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    loras = [
        None if a is None or not use_adapters else LoRARequest(a, adapters[a]) for a in ADAPTER_OF
    ]
    outs = llm.generate(PROMPTS, params, lora_request=loras, use_tqdm=False)
    result = []
    for out in outs:
        comp = out.outputs[0]
        assert comp.logprobs is not None
        steps = []
        for tok, lps in zip(comp.token_ids, comp.logprobs, strict=True):
            other = max((t for t in lps if t != tok), key=lambda t: lps[t].logprob)
            steps.append((tok, lps[tok].logprob, other, lps[other].logprob))
        result.append(steps)
    return result


@pytest.mark.parametrize("arch", list(MODELS))
def test_tp2_equals_tp1_greedy(models: dict[str, tuple[str, dict[str, str]]], arch: str) -> None:
    model_dir, adapters = models[arch]
    single = LLM(model_dir, **KNOBS)
    ref = greedy(single, adapters)
    base_only = [[s[0] for s in steps] for steps in greedy(single, adapters, use_adapters=False)]
    single.llm_engine.core.close()
    for i, steps in enumerate(ref):
        margins = [chosen - other for _, chosen, _, other in steps]
        assert min(margins) > MIN_MARGIN, (
            f"prompt {i}: a near-tie (margins {margins}); pick another seed for this test"
        )
    llm = LLM(model_dir, tensor_parallel_size=2, **KNOBS)
    try:
        ours = greedy(llm, adapters)
        workers = llm.llm_engine.core.workers
        assert workers is not None and len(workers.procs) == 1
    finally:
        llm.llm_engine.core.close()
    for i, (a, b) in enumerate(zip(ref, ours, strict=True)):
        label = f"prompt {i} ({ADAPTER_OF[i] or 'base'})"
        assert [s[0] for s in b] == [s[0] for s in a], label
        for k, (s1, s2) in enumerate(zip(a, b, strict=True)):
            assert s1[2] == s2[2], (label, k, "runner-up", s1, s2)
            assert abs(s1[1] - s2[1]) < LOGPROB_TOL, (label, k, s1, s2)
            assert abs(s1[3] - s2[3]) < LOGPROB_TOL, (label, k, s1, s2)
    # each adapter changes its prompt's tokens: the comparison covers the sharded adapter math
    for i, a in enumerate(ADAPTER_OF):
        if a is not None:
            assert [s[0] for s in ref[i]] != base_only[i], f"prompt {i}: {a} changed nothing"


def test_dead_worker_fails_the_engine_clearly(
    models: dict[str, tuple[str, dict[str, str]]],
) -> None:
    model_dir, _ = models["llama"]
    llm = LLM(model_dir, tensor_parallel_size=2, **KNOBS)
    workers = llm.llm_engine.core.workers
    assert workers is not None
    proc = workers.procs[1]
    try:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)  # it works
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        # fails at once (gloo sees the closed peer), not after a collective timeout: a hang
        # would stop this test at pytest's timeout
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(TensorParallelError, match="cannot run another step"):
            llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.llm_engine.core.close()


def test_no_worker_outlives_a_killed_engine(
    models: dict[str, tuple[str, dict[str, str]]], tmp_path: Path
) -> None:
    """The engine's process dies without any cleanup (SIGKILL): its worker exits too."""
    model_dir, _ = models["llama"]
    script = textwrap.dedent(
        f"""
        import sys, time
        from loraplex.llm import LLM
        llm = LLM({model_dir!r}, tensor_parallel_size=2, dtype="float32", max_model_len=64)
        print(llm.llm_engine.core.workers.procs[1].pid, flush=True)
        time.sleep(600)
        """
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    engine = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert engine.stdout is not None
        worker_pid = int(engine.stdout.readline())
        engine.kill()
        engine.wait(timeout=60)
        deadline = time.monotonic() + 60  # a bound for a paused machine, not a timing check
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker_pid), f"worker {worker_pid} outlived its engine"
    finally:
        engine.kill()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and waiting for its reaper, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_unsupported_combinations_are_refused() -> None:
    """Clear errors before any worker starts."""
    from types import SimpleNamespace

    from loraplex.engine.models.parallel import check_shardable
    from loraplex.engine_args import engine_config

    with pytest.raises(ValueError, match=r"triton.*tensor_parallel_size"):
        engine_config(tensor_parallel_size=2, attention_backend="triton")
    with pytest.raises(ValueError, match=r"draft model.*tensor_parallel_size"):
        engine_config(
            tensor_parallel_size=2,
            speculative_config={"method": "draft_model", "model": "d", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="at least 1"):
        engine_config(tensor_parallel_size=0)

    def cfg(heads: int, kv: int, inter: int = 128) -> SimpleNamespace:
        return SimpleNamespace(
            num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter
        )

    check_shardable(cfg(8, 2), 4)  # one KV head replicated on two ranks each
    check_shardable(cfg(8, 8), 4)
    with pytest.raises(ValueError, match=r"number of attention heads \(4\)"):
        check_shardable(cfg(4, 2), 3)
    with pytest.raises(ValueError, match="intermediate_size"):
        check_shardable(cfg(4, 2, inter=130), 4)
    with pytest.raises(ValueError, match=r"key/value heads \(3\)"):
        check_shardable(cfg(6, 3), 2)
    with pytest.raises(ValueError, match="neither a divisor nor a multiple of the model's 3"):
        check_shardable(cfg(12, 3), 4)
