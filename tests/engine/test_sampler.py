"""Sampler: greedy, seeded reproducibility, truncation, penalties and logprobs (vLLM semantics)."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from loraplex.engine.records import token_bitmask
from loraplex.engine.sampler import Sampler, SampleRow
from loraplex.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 64


def row(
    rid: str = "r",
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    **params: object,
) -> SampleRow:
    return SampleRow(rid, SamplingParams(**params), prompt or [], output or [])  # type: ignore[arg-type]


def logits_of(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()  # [rows, len(probs)]


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_all_greedy_is_argmax_with_no_sort_or_softmax(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    logits = torch.randn(8, V, generator=gen)
    for name in ("sort", "softmax", "exponential_"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(_n))
    tokens, lps = Sampler(V, CPU)(logits, [row(f"r{i}", temperature=0.0) for i in range(8)])
    assert tokens == logits.argmax(-1).tolist()
    assert all(type(t) is int for t in tokens)
    assert lps == [None] * 8


def test_greedy_rows_stay_argmax_in_a_mixed_batch(gen: torch.Generator) -> None:
    logits = torch.randn(6, V, generator=gen)
    rows = [row(f"r{i}", temperature=0.0 if i % 2 else 1.5, top_p=0.9) for i in range(6)]
    tokens, _ = Sampler(V, CPU)(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


def test_top_k_alone_does_not_sort(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(4, V, generator=gen)
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: pytest.fail("sorted"))
    tokens, _ = Sampler(V, CPU)(logits, [row(f"r{i}", top_k=1) for i in range(4)])
    assert tokens == logits.argmax(-1).tolist()


def test_does_not_write_to_the_input_logits(gen: torch.Generator) -> None:
    logits = torch.randn(3, V, generator=gen)
    before = logits.clone()
    rows = [
        row("a", [1, 2], [3], repetition_penalty=1.5, presence_penalty=1.0, top_k=5, min_p=0.1),
        row("b", top_p=0.5, temperature=0.7),
        row("c", temperature=0.0, frequency_penalty=1.0, output=[4, 4]),
    ]
    Sampler(V, CPU)(logits, rows)
    assert torch.equal(logits, before)


def test_padded_vocab_columns_are_never_sampled() -> None:
    logits = torch.zeros(1, V + 8)
    logits[0, V:] = 100.0  # padding columns with huge logits
    sampler = Sampler(V, CPU)
    assert sampler(logits, [row(temperature=0.0)])[0][0] < V
    tokens = sampler(logits.expand(500, -1), [row(f"r{i}") for i in range(500)])[0]
    assert max(tokens) < V


# -- seeds -------------------------------------------------------------------------------------


def run_steps(
    sampler: Sampler, batches: Iterator[tuple[torch.Tensor, list[SampleRow]]]
) -> list[int]:
    """The tokens of request "seeded" over several steps."""
    out = []
    for logits, rows in batches:
        tokens, _ = sampler(logits, rows)
        out.append(tokens[[r.request_id for r in rows].index("seeded")])
    return out


def test_seeded_request_is_reproducible_across_batches_and_rows(gen: torch.Generator) -> None:
    steps = [torch.randn(V, generator=gen) for _ in range(6)]  # the seeded request's logits

    def alone() -> Iterator[tuple[torch.Tensor, list[SampleRow]]]:
        for step in steps:
            yield step.unsqueeze(0), [row("seeded", seed=7)]

    def crowded(position: int) -> Iterator[tuple[torch.Tensor, list[SampleRow]]]:
        for n, step in enumerate(steps):
            others = [row("x"), row("y", seed=7), row("z", seed=3, top_p=0.5), row(f"g{n}", seed=1)]
            rows = [*others[:position], row("seeded", seed=7), *others[position:]]
            logits = torch.randn(5, V, generator=gen)  # [5, V]
            logits[position] = step
            yield logits, rows

    expected = run_steps(Sampler(V, CPU), alone())
    assert run_steps(Sampler(V, CPU), crowded(0)) == expected
    assert run_steps(Sampler(V, CPU), crowded(3)) == expected
    assert len(set(expected)) > 1  # actually random, not collapsed to argmax


def test_other_seed_differs_and_forget_restarts_the_generator(gen: torch.Generator) -> None:
    logits = torch.zeros(1, 1000)  # uniform
    sampler = Sampler(1000, CPU)
    first = [sampler(logits, [row("seeded", seed=7)])[0][0] for _ in range(5)]
    other = [sampler(logits, [row("other", seed=8)])[0][0] for _ in range(5)]
    sampler.forget(["seeded"])
    again = [sampler(logits, [row("seeded", seed=7)])[0][0] for _ in range(5)]
    assert again == first
    assert other != first


# -- truncation and distributions --------------------------------------------------------------

PROBS = [0.1, 0.4, 0.2, 0.3]
N = 20_000


def draw(**params: object) -> collections.Counter[int]:
    """N samples of PROBS in one batch of N rows (default generator seeded: no flakes)."""
    torch.manual_seed(0)
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    rows = [SampleRow(f"r{i}", sp, [], []) for i in range(N)]
    return collections.Counter(Sampler(4, CPU)(logits_of(PROBS, N), rows)[0])


def assert_frequencies(counts: collections.Counter[int], expected: list[float]) -> None:
    for token, p in enumerate(expected):
        # 5 standard deviations of a binomial frequency: fails by chance < 1e-5.
        assert abs(counts[token] / N - p) <= 5 * math.sqrt(p * (1 - p) / N) + 1e-9, (token, counts)


def test_temperature_one_samples_the_softmax() -> None:
    assert_frequencies(draw(), PROBS)


def test_temperature_sharpens_and_flattens() -> None:
    for t in (0.5, 2.0):
        weights = [p ** (1 / t) for p in PROBS]
        assert_frequencies(draw(temperature=t), [w / sum(weights) for w in weights])


def test_extreme_temperatures_sample_without_raising() -> None:
    # 1 / 1e300 underflows fp32: the sampler holds it at the smallest scale it passes on, so a
    # huge temperature draws uniformly instead of failing the step; just above greedy is argmax.
    tokens = draw(temperature=1e300)
    assert_frequencies(tokens, [0.25] * 4)
    assert set(draw(temperature=2e-5)) == {1}


def test_top_k_keeps_the_k_most_likely_renormalized() -> None:
    assert_frequencies(draw(top_k=2), [0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7])
    assert set(draw(top_k=1)) == {1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Most likely first: 0.4, 0.3 (cumulative 0.7 >= 0.5): tokens 1 and 3 survive.
    assert_frequencies(draw(top_p=0.5), [0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7])
    assert set(draw(top_p=1e-6)) == {1}
    # top-k first, then top-p over the renormalized survivors: 0.4/0.7 >= 0.5 alone.
    assert set(draw(top_k=2, top_p=0.5)) == {1}


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    # min_p=0.3: threshold 0.12 drops token 0 (0.1) only.
    assert_frequencies(draw(min_p=0.3), [0.0, 0.4 / 0.9, 0.2 / 0.9, 0.3 / 0.9])


def test_mixed_truncation_settings_in_one_batch(gen: torch.Generator) -> None:
    logits = torch.randn(1, V, generator=gen).expand(400, -1)  # [400, V]
    top3 = set(logits[0].topk(3).indices.tolist())
    rows = [
        row(f"r{i}", **({"top_k": 3} if i % 4 == 0 else {"top_p": 1e-6} if i % 4 == 1 else {}))
        for i in range(400)
    ]
    tokens, _ = Sampler(V, CPU)(logits, rows)
    assert {tokens[i] for i in range(0, 400, 4)} == top3
    assert {tokens[i] for i in range(1, 400, 4)} == {int(logits[0].argmax())}
    assert len({tokens[i] for i in range(2, 400, 4)}) > 3  # untruncated rows stay untruncated


# -- penalties ---------------------------------------------------------------------------------


def test_penalties_match_a_hand_computed_expectation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -2.0, 3.0, 1.0]])
    r = row("a", prompt=[1, 2], output=[2, 3, 3], repetition_penalty=2.0,
            presence_penalty=0.5, frequency_penalty=0.25)  # fmt: skip
    got = Sampler(6, CPU)._apply_penalties(logits, [r], [0])
    expected = [
        2.0,  # unseen
        -1.0 * 2.0,  # prompt only: repetition, negative -> multiplied
        0.5 / 2.0 - 0.5 - 0.25 * 1,  # prompt and output once
        -2.0 * 2.0 - 0.5 - 0.25 * 2,  # output twice
        3.0,
        1.0,
    ]
    assert got[0].tolist() == pytest.approx(expected)


def test_penalties_touch_only_the_rows_that_ask() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]] * 3)
    rows = [
        row("a", [0], [2], presence_penalty=2.0),
        row("b", [0], [2]),
        row("c", [0], [2], repetition_penalty=3.0),
    ]
    got = Sampler(3, CPU)._apply_penalties(logits, rows, [0, 2])
    expected = [[1.0, 2.0, 1.0], [1.0, 2.0, 3.0], [1 / 3, 2.0, 1.0]]
    assert got.tolist() == [pytest.approx(r) for r in expected]


def test_penalties_apply_before_greedy() -> None:
    logits = torch.tensor([[1.0, 2.0, 1.5]])
    sampler = Sampler(3, CPU)
    assert sampler(logits, [row(temperature=0.0)])[0] == [1]
    assert sampler(logits, [row("p", [1], temperature=0.0, repetition_penalty=2.0)])[0] == [2]
    assert sampler(logits, [row("f", output=[1, 1], temperature=0.0, frequency_penalty=0.3)])[
        0
    ] == [2]


# -- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_rank_and_top(gen: torch.Generator) -> None:
    logits = torch.randn(4, V, generator=gen)
    rows = [
        row("a", logprobs=5, temperature=0.0),
        row("b"),
        row("c", logprobs=0, output=[1, 1], frequency_penalty=2.0, temperature=0.3),
        row("d", logprobs=20, top_k=10),
    ]
    tokens, lps = Sampler(V, CPU)(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert lps[1] is None
    for i, n in ((0, 5), (2, 0), (3, 20)):
        lp = lps[i]
        assert lp is not None and lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(ref[i, tokens[i]].item(), abs=1e-5)
        assert lp.rank == 1 + int((ref[i] > ref[i, tokens[i]]).sum())
        assert [t for t, _ in lp.top] == ref[i].argsort(descending=True)[:n].tolist()
        assert [x for _, x in lp.top] == pytest.approx(
            ref[i].sort(descending=True).values[:n].tolist(), abs=1e-5
        )
        assert all(type(t) is int for t, _ in lp.top)
    assert lps[0] is not None and lps[0].rank == 1  # greedy picks the most likely


# -- the per-step token mask hook (structured output) ------------------------------------------


def test_token_bitmask_layout() -> None:
    mask = token_bitmask([0, 31, 32, 69], 70)
    assert mask.dtype == np.int32 and mask.shape == (3,)
    words = mask.view(np.uint32).tolist()
    assert words == [1 | 1 << 31, 1, 1 << 5]
    with pytest.raises(ValueError, match=r"0\.\.69"):
        token_bitmask([70], 70)
    assert not token_bitmask([], 70).any()


def test_a_mask_forces_its_token_greedy_random_and_seeded(gen: torch.Generator) -> None:
    logits = torch.randn(6, V, generator=gen)
    before = logits.clone()
    rows = [
        row("g", temperature=0.0),
        row("r", temperature=1.0, top_p=0.9),
        row("s", temperature=0.8, seed=3),
        row("g2", temperature=0.0),
        row("r2", temperature=1.0),
        row("s2", temperature=0.8, seed=5),
    ]
    forced = int(logits[0].argmin())  # never the argmax
    masks = {i: token_bitmask([forced], V) for i in range(3)}
    tokens, _ = Sampler(V, CPU)(logits, rows, masks)
    assert tokens[:3] == [forced] * 3
    # unmasked rows sample as they would without any mask
    alone, _ = Sampler(V, CPU)(logits, rows)
    assert tokens[3] == alone[3] == int(logits[3].argmax()) and tokens[5] == alone[5]
    assert torch.equal(logits, before)  # the input is never written to


def test_random_rows_stay_inside_their_mask(gen: torch.Generator) -> None:
    n = 200
    logits = torch.randn(n, V, generator=gen)
    allowed = {3, 5, 9}
    rows = [row(f"r{i}", temperature=1.5, top_k=20) for i in range(n)]
    tokens, _ = Sampler(V, CPU)(logits, rows, {i: token_bitmask(allowed, V) for i in range(n)})
    assert set(tokens) <= allowed and len(set(tokens)) > 1


def test_logprobs_are_those_of_the_masked_distribution(gen: torch.Generator) -> None:
    logits = torch.randn(1, V, generator=gen)
    (tok,), (lp,) = Sampler(V, CPU)(
        logits, [row(temperature=0.0, logprobs=3)], {0: token_bitmask([7, 9], V)}
    )
    assert lp is not None and lp.token_id == tok and lp.rank == 1
    assert {t for t, _ in lp.top[:2]} == {7, 9} and lp.top[2][1] == -math.inf
    want = torch.log_softmax(logits[0, [7, 9]], dim=-1)
    assert math.isclose(math.exp(lp.logprob), float(want.exp().max()), rel_tol=1e-5)


def test_no_masks_no_work(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Sampler, "_apply_token_masks", lambda *a: pytest.fail("masked"))
    logits = torch.randn(3, V, generator=gen)
    rows = [row(f"r{i}", temperature=0.0) for i in range(3)]
    assert Sampler(V, CPU)(logits, rows)[0] == Sampler(V, CPU)(logits, rows, {})[0]


def test_a_mask_too_short_for_the_vocabulary_is_refused(gen: torch.Generator) -> None:
    with pytest.raises(ValueError, match="at least 2 words"):
        Sampler(V, CPU)(torch.randn(1, V, generator=gen), [row()], {0: token_bitmask([1], 32)})
