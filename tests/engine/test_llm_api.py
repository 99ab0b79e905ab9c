"""The offline API: input validation, sampling options end to end, n > 1, stats, priorities
under the priority and fair policies."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import SamplingParams
from loraplex.engine.records import SchedulerOutput
from loraplex.llm import LLM
from tests.utils.models import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("api") / "m", "llama", seed=4)
    return LLM(model_dir, max_model_len=128, block_size=4, num_blocks=200)


GOOD = [5, 6, 7, 8]


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", dict(), "prompt"),
        ([], dict(), "prompt"),
        (list(range(3, 200)), dict(), "prompt"),  # 197 tokens > max_model_len 128
        ([5, 600], dict(), "prompt_token_ids"),  # vocabulary is 512
        ([5, -1], dict(), "prompt_token_ids"),
    ],
)
def test_bad_prompt_is_a_value_error_and_engine_keeps_serving(
    llm: LLM, prompt: object, params: dict[str, object], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate([GOOD, prompt], SamplingParams(max_tokens=3), use_tqdm=False)  # type: ignore[list-item]
    # Nothing of the bad call stays queued; the engine serves the next call normally.
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([GOOD], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),  # the sampler's 1 / T must be a number
        (dict(temperature=float("inf")), "temperature"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n"),
        (dict(logprobs=50), "logprobs"),
        (dict(top_k=-3), "top_k"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_prompt_order_and_one_params_per_prompt(llm: LLM) -> None:
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (2, 5, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5, 3]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 3 prompts"):
        llm.generate(prompts, params[:2], use_tqdm=False)


def test_seed_gives_same_output_whatever_the_batch(llm: LLM) -> None:
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    alone = llm.generate([GOOD], p, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [[i, i + 1, i + 2] for i in range(20, 40)]
    mixed = llm.generate(
        [*crowd[:7], GOOD, *crowd[7:]],
        SamplingParams(max_tokens=12, temperature=1.0),
        use_tqdm=False,
    )
    with_seed = llm.generate(
        [*crowd[:3], GOOD],
        [SamplingParams(max_tokens=12, temperature=1.0)] * 3 + [p],
        use_tqdm=False,
    )
    assert with_seed[3].outputs[0].token_ids == alone
    assert mixed[7].outputs[0].token_ids  # unseeded: any output, but it runs


def test_n_samples_share_prompt_and_differ(llm: LLM) -> None:
    before = llm.engine_stats().num_prompt_tokens_computed
    prompt = list(range(40, 70))  # 30 tokens: 7 full blocks of 4 and a partial one
    out = llm.generate(
        [prompt], SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=7), use_tqdm=False
    )[0]
    assert len(out.outputs) == 4
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct seeds per sample
    # The prompt was computed once for the four samples (forked, copy-on-write).
    assert llm.engine_stats().num_prompt_tokens_computed - before == len(prompt)
    again = llm.generate(
        [prompt], SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=7), use_tqdm=False
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_token_ids_and_logprobs(llm: LLM) -> None:
    greedy = llm.generate(
        [GOOD], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    out = llm.generate(
        [GOOD],
        SamplingParams(
            max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_at], logprobs=3
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in entry and entry[tok].rank == 1  # greedy: the sampled token is the top one
        assert len(entry) == 3


def test_stop_string_not_in_text(llm: LLM) -> None:
    # The word-level tokenizer decodes token i as "t{i}" separated by spaces.
    greedy = llm.generate(
        [GOOD], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    words = greedy.text.split()
    stop = words[2]
    out = llm.generate(
        [GOOD],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text
    assert greedy.text.startswith(out.text)


def test_max_model_len_caps_output(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=1)
    small = LLM(model_dir, max_model_len=16)
    out = small.generate(
        [list(range(3, 13))], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_priority_one_for_all_or_one_per_prompt(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    core = llm.llm_engine.core
    seen: list[tuple[str, int]] = []
    add = core.add_request
    monkeypatch.setattr(
        core, "add_request", lambda r: (seen.append((r.request_id, r.priority)), add(r))[1]
    )
    p = SamplingParams(max_tokens=1)
    llm.generate([GOOD, GOOD], p, use_tqdm=False, priority=[2, -1])
    llm.generate([GOOD], p, use_tqdm=False, priority=5)
    llm.generate([GOOD], p, use_tqdm=False)
    assert [prio for _, prio in seen] == [2, -1, 5, 0]
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate([GOOD, GOOD], p, use_tqdm=False, priority=[1])
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_scheduling_policy_orders_admission_and_keeps_outputs(llm: LLM, policy: str) -> None:
    """One seat: the priority -1 prompt is admitted first, then 0, then 1; the tokens are those
    of FCFS."""
    ordered = LLM(
        llm.llm_engine.model_dir,
        max_model_len=128,
        block_size=4,
        num_blocks=200,
        max_num_seqs=1,
        scheduling_policy=policy,  # type: ignore[arg-type]
    )
    sched = ordered.llm_engine.core.scheduler
    first_scheduled: list[str] = []
    schedule = sched.schedule

    def record() -> SchedulerOutput:
        out = schedule()
        first_scheduled.extend(s.request_id for s in out.requests if s.start_pos == 0)
        return out

    sched.schedule = record  # type: ignore[method-assign]
    prompts = [[5, 6, 7], [9, 10, 11, 12], [20, 21]]
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    got = ordered.generate(prompts, p, use_tqdm=False, priority=[1, -1, 0])
    want = llm.generate(prompts, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    index = {o.request_id: i for i, o in enumerate(got)}
    assert [index[rid] for rid in first_scheduled] == [1, 2, 0]
