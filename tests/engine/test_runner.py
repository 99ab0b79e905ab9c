"""ModelRunner: chunked prefill, mixed batches, copy-on-write and forks against Hugging Face."""

from __future__ import annotations

import pytest
import torch

import loraplex.engine.runner as runner_mod
from loraplex.config import CacheConfig, ModelConfig, SchedulerConfig
from loraplex.engine.attention.select import select_backend
from loraplex.engine.attention.torch_backend import TorchPagedAttention
from loraplex.engine.records import (
    ForkedSample,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    token_bitmask,
)
from loraplex.engine.runner import ModelRunner
from loraplex.sampling_params import SamplingParams
from tests.utils.model_fixtures import GreedySampler, hf_logits, save_tiny

BLOCK = 4
CPU, F32 = torch.device("cpu"), torch.float32
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    path = tmp_path_factory.mktemp("llama_gqa")
    hf = save_tiny("llama_gqa", path, seed=5)
    return str(path), hf


def make_runner(path: str, monkeypatch: pytest.MonkeyPatch | None = None) -> ModelRunner:
    if monkeypatch is not None:
        monkeypatch.setattr(runner_mod, "Sampler", GreedySampler)
    runner = ModelRunner(
        ModelConfig(max_model_len=128),
        CacheConfig(block_size=BLOCK, num_blocks=48),
        SchedulerConfig(),
        path,
    )
    assert runner.init_kv_cache() == 48
    return runner


def step(
    rid: str,
    toks: list[int],
    start: int,
    table: list[int],
    sample: bool = True,
    prompt: list[int] | None = None,
) -> ScheduledRequest:
    return ScheduledRequest(rid, toks, start, table, sample, GREEDY, prompt or [], [])


def one(res: RunnerOutput, rid: str) -> int:
    """The token sampled for ``rid`` this step: today the runner samples exactly one."""
    (token,) = res.sampled[rid]
    return token


def hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    out = []
    for _ in range(n):
        tok = int(hf_logits(hf, ids)[-1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def test_chunked_prefill_then_decode_matches_hf(model_dir: tuple[str, torch.nn.Module]) -> None:
    path, hf = model_dir
    runner = make_runner(path)  # the real sampler, greedy
    prompt = [(7 * i + 3) % 211 for i in range(22)]
    table = [17, 3, 40, 9, 22, 1, 33, 12]  # non-contiguous, 32 slots
    # chunks of 8, 9, 5 over three steps; only the last one samples
    assert (
        runner.execute(SchedulerOutput([step("a", prompt[:8], 0, table, sample=False)])).sampled
        == {}
    )
    assert (
        runner.execute(SchedulerOutput([step("a", prompt[8:17], 8, table, sample=False)])).sampled
        == {}
    )
    res = runner.execute(SchedulerOutput([step("a", prompt[17:], 17, table)]))
    generated = [one(res, "a")]
    for _ in range(5):  # decode steps
        pos = len(prompt) + len(generated) - 1
        res = runner.execute(SchedulerOutput([step("a", [generated[-1]], pos, table)]))
        generated.append(one(res, "a"))
    assert generated == hf_greedy(hf, prompt, 6)


def test_mixed_decode_and_prefill_batch(
    model_dir: tuple[str, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, hf = model_dir
    runner = make_runner(path, monkeypatch)
    a = [5, 9, 100, 42, 7, 8, 1, 77, 3, 19, 50]
    b = [(11 * i + 1) % 211 for i in range(14)]
    c = [8, 8, 9, 150, 201, 13]
    ta, tb, tc = [4, 30, 11, 2], [7, 19, 25, 5], [44, 6]
    runner.execute(SchedulerOutput([step("a", a[:-1], 0, ta, sample=False)]))
    runner.execute(SchedulerOutput([step("c", c[:3], 0, tc, sample=False)]))
    # one step: a decodes its last prompt token, b prefills its first chunk, c finishes its prompt
    out = SchedulerOutput(
        [
            step("b", b[:10], 0, tb, sample=False),
            step("a", a[-1:], len(a) - 1, ta),
            step("c", c[3:], 3, tc),
        ]
    )
    res = runner.execute(out)
    logits, ids = runner.sampler.calls[-1]  # type: ignore[attr-defined]
    assert ids == ["a", "c"]
    torch.testing.assert_close(logits[0], hf_logits(hf, a)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_logits(hf, c)[-1], atol=1e-4, rtol=1e-4)
    # next step: b finishes its prompt while a and c decode
    res = runner.execute(
        SchedulerOutput(
            [
                step("a", [one(res, "a")], len(a), ta),
                step("b", b[10:], 10, tb),
                step("c", [one(res, "c")], len(c), tc),
            ]
        )
    )
    assert one(res, "b") == hf_greedy(hf, b, 1)[0]
    assert one(res, "a") == hf_greedy(hf, a, 2)[1]
    assert one(res, "c") == hf_greedy(hf, c, 2)[1]


def test_copy_on_write_and_forks(
    model_dir: tuple[str, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, hf = model_dir
    runner = make_runner(path, monkeypatch)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]  # 2 full blocks + 2 tokens
    parent_table = [10, 20, 30]
    res = runner.execute(
        SchedulerOutput(
            [step("p", prompt, 0, parent_table)],
            forks=[ForkedSample("p#1", "p", GREEDY, prompt, [])],
        )
    )
    assert one(res, "p") == one(res, "p#1") == hf_greedy(hf, prompt, 1)[0]
    logits, ids = runner.sampler.calls[-1]  # type: ignore[attr-defined]
    assert ids == ["p", "p#1"] and torch.equal(logits[0], logits[1])  # a fork reuses the row
    # the child shares blocks 10, 20 and gets a private copy of the partial block 30 -> 31
    child_table = [10, 20, 31]
    t_parent, t_child = 120, 7
    runner.execute(
        SchedulerOutput(
            [step("p", [t_parent], 10, parent_table), step("p#1", [t_child], 10, child_table)],
            blocks_to_copy=[(30, 31)],
        )
    )
    logits, _ = runner.sampler.calls[-1]  # type: ignore[attr-defined]
    torch.testing.assert_close(
        logits[0], hf_logits(hf, [*prompt, t_parent])[-1], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        logits[1], hf_logits(hf, [*prompt, t_child])[-1], atol=1e-4, rtol=1e-4
    )


def test_prefix_cache_hit_attends_to_earlier_blocks(
    model_dir: tuple[str, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, hf = model_dir
    runner = make_runner(path, monkeypatch)
    shared = list(range(40, 48))  # two full blocks, computed once by request x
    runner.execute(SchedulerOutput([step("x", shared, 0, [5, 6], sample=False)]))
    tail = [9, 10, 11]
    runner.execute(SchedulerOutput([step("y", tail, 8, [5, 6, 7])]))  # starts at the cached prefix
    logits, _ = runner.sampler.calls[-1]  # type: ignore[attr-defined]
    torch.testing.assert_close(logits[0], hf_logits(hf, shared + tail)[-1], atol=1e-4, rtol=1e-4)


def test_empty_output_and_forget(
    model_dir: tuple[str, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(model_dir[0], monkeypatch)
    res = runner.execute(SchedulerOutput([], finished_request_ids=["gone"]))
    assert res.sampled == {} and res.logprobs == {}
    assert runner.sampler.forgotten == ["gone"]  # type: ignore[attr-defined]


def test_logprobs_from_real_sampler(model_dir: tuple[str, torch.nn.Module]) -> None:
    runner = make_runner(model_dir[0])
    params = SamplingParams(temperature=0.0, logprobs=2)
    res = runner.execute(
        SchedulerOutput([ScheduledRequest("q", [1, 2, 3], 0, [3], True, params, [1, 2, 3], [])])
    )
    (lp,) = res.logprobs["q"]
    assert lp.token_id == one(res, "q") and lp.rank == 1 and len(lp.top) == 2


def test_kv_cache_sizing(model_dir: tuple[str, torch.nn.Module]) -> None:
    path = model_dir[0]
    sched = SchedulerConfig(max_num_seqs=4)
    model = ModelConfig(max_model_len=64)
    per_block = 2 * 3 * BLOCK * 2 * 16 * 4  # K+V, 3 layers, 2 kv heads of 16, fp32
    r = ModelRunner(
        model, CacheConfig(block_size=BLOCK, kv_cache_memory=10 * per_block + 5), sched, path
    )
    assert r.spec.kv_bytes_per_block(BLOCK) == per_block
    assert r.init_kv_cache() == 10
    assert r.kv_cache is not None and r.kv_cache.abs().sum() == 0
    r = ModelRunner(model, CacheConfig(block_size=BLOCK), sched, path)
    assert r.init_kv_cache() == 4 * (64 // BLOCK) + 1  # every sequence at full length + null block
    r = ModelRunner(model, CacheConfig(block_size=BLOCK, kv_cache_memory=per_block), sched, path)
    with pytest.raises(ValueError, match="at least 2"):
        r.init_kv_cache()
    with pytest.raises(ValueError, match="exceeds the model's maximum context"):
        ModelRunner(ModelConfig(max_model_len=1000), CacheConfig(), sched, path)


def test_short_block_table_is_refused(model_dir: tuple[str, torch.nn.Module]) -> None:
    runner = make_runner(model_dir[0])
    with pytest.raises(ValueError, match="block table of 1 blocks cannot hold 6 tokens"):
        runner.execute(SchedulerOutput([step("z", [1, 2, 3, 4, 5, 6], 0, [3])]))


def test_token_masks_reach_the_sampler(model_dir: tuple[str, torch.nn.Module]) -> None:
    path, hf = model_dir
    runner = make_runner(path)  # the real sampler, greedy
    prompt = [3, 14, 15, 92, 65]
    free = hf_greedy(hf, prompt, 1)[0]
    forced = (free + 1) % runner.spec.vocab_size
    vocab = runner.spec.vocab_size
    res = runner.execute(
        SchedulerOutput(
            [step("p", prompt, 0, [1, 2]), step("q", prompt, 0, [3, 4])],
            forks=[ForkedSample("p#1", "p", GREEDY, prompt, [])],
            token_masks={
                "p#1": token_bitmask([forced], vocab),
                "q": token_bitmask([forced], vocab),
            },
        )
    )
    # the parent row samples freely, its fork (same logits row) and q within their masks
    assert (one(res, "p"), one(res, "p#1"), one(res, "q")) == (free, forced, forced)


def test_attention_backend_from_the_config(model_dir: tuple[str, torch.nn.Module]) -> None:
    path, hf = model_dir
    prompt = [3, 14, 15, 92, 65, 35]
    for name in ("torch", "auto"):
        runner = ModelRunner(
            ModelConfig(max_model_len=128, attention_backend=name),  # type: ignore[arg-type]
            CacheConfig(block_size=BLOCK, num_blocks=48),
            SchedulerConfig(),
            path,
        )
        runner.init_kv_cache()
        want = TorchPagedAttention if name == "torch" else type(select_backend("auto", CPU, F32))
        assert type(runner.attn) is want
        res = runner.execute(SchedulerOutput([step("a", prompt, 0, [1, 2])]))
        decode = runner.execute(SchedulerOutput([step("a", [one(res, "a")], 6, [1, 2])]))
        assert [one(res, "a"), one(decode, "a")] == hf_greedy(hf, prompt, 2)
