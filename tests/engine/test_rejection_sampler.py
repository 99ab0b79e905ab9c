"""Verification of draft tokens in isolation: the accepted prefix, the rows a drafted request
samples, and, through the real ``Sampler``, that the tokens it emits are distributed as the
target's: acceptance with probability p(d), on rejection p without d renormalised, and the
next position as the target says given an accepted draft (Leviathan et al. for a point-mass
draft). Seeded requests emit the very tokens they sample without drafts."""

from __future__ import annotations

import collections

import pytest
import torch

from loraplex.engine.records import ScheduledRequest, TokenLogprobs
from loraplex.engine.rejection_sampler import accept_drafts, num_accepted, verification_rows
from loraplex.engine.sampler import Sampler, SampleRow
from loraplex.sampling_params import SamplingParams

CPU = torch.device("cpu")


def test_num_accepted_is_the_longest_agreeing_prefix() -> None:
    assert num_accepted([5, 6, 7], [5, 6, 7, 8]) == 3  # all accepted, 8 the bonus
    assert num_accepted([5, 6, 7], [5, 9, 7, 8]) == 1  # 9 corrects the second draft
    assert num_accepted([5, 6, 7], [4, 6, 7, 8]) == 0
    assert num_accepted([], [4]) == 0
    with pytest.raises(ValueError, match="one sampled token per draft plus one"):
        num_accepted([5, 6], [5, 6])


def scheduled(rid: str, output: list[int], drafts: list[int], **params: object) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid,
        token_ids=[output[-1], *drafts],
        start_pos=10,
        block_table=[1],
        sample=True,
        params=SamplingParams(**params),  # type: ignore[arg-type]
        prompt_token_ids=[1, 2],
        output_token_ids=output,
        draft_token_ids=drafts,
    )


def test_each_row_sees_the_output_and_the_drafts_before_it() -> None:
    rows = verification_rows(scheduled("a", [7, 8], [20, 21]))
    assert [r.output_token_ids for r in rows] == [[7, 8], [7, 8, 20], [7, 8, 20, 21]]
    assert all(r.request_id == "a" and r.prompt_token_ids == [1, 2] for r in rows)
    assert len(verification_rows(scheduled("b", [7], []))) == 1


def lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -1.0, 1, [])


def test_accept_drafts_slices_tokens_and_logprobs_per_request() -> None:
    rows = [
        *verification_rows(scheduled("a", [7], [20, 21, 22])),  # rows 0..3
        *verification_rows(scheduled("b", [7], [])),  # row 4
        *verification_rows(scheduled("c", [7], [30])),  # rows 5..6
        SampleRow("fork", SamplingParams(), [1], []),  # row 7
    ]
    tokens = [20, 21, 99, 98, 40, 30, 31, 50]
    logprobs = [lp(t) for t in tokens]
    out = accept_drafts(rows, tokens, logprobs, {"a": [20, 21, 22], "c": [30]})
    assert out.sampled == {"a": [20, 21, 99], "b": [40], "c": [30, 31], "fork": [50]}
    assert [x.token_id for x in out.logprobs["a"]] == [20, 21, 99]
    assert [x.token_id for x in out.logprobs["c"]] == [30, 31]
    no_lps = accept_drafts(rows, tokens, [None] * len(tokens), {"a": [20, 21, 22], "c": [30]})
    assert no_lps.logprobs == {}


# ---- the distribution ------------------------------------------------------------------------

P0 = [0.05, 0.35, 0.25, 0.2, 0.1, 0.05]  # the target at the first position
P1 = [0.4, 0.1, 0.1, 0.1, 0.2, 0.1]  # ... at the next, given the draft was accepted
N = 20_000
TV_BOUND = 0.02  # sampling noise of N draws over 6 tokens is about 0.01


def tv(counts: collections.Counter[int], n: int, probs: list[float]) -> float:
    return 0.5 * sum(abs(counts[t] / n - p) for t, p in enumerate(probs))


# a likely draft, and an unlikely one at another temperature (seeded: deterministic, no flakes)
@pytest.mark.parametrize(("draft", "temperature"), [(1, 1.0), (4, 0.7)])
def test_emitted_tokens_follow_the_target_distribution(draft: int, temperature: float) -> None:
    """N seeded requests, each with one draft ``draft``: two rows, the target's P0 then P1."""
    p0 = torch.tensor(P0).log()
    p1 = torch.tensor(P1).log()
    q0 = (p0 / temperature).softmax(-1).tolist()  # what the sampler samples from
    q1 = (p1 / temperature).softmax(-1).tolist()
    sampler = Sampler(len(P0), CPU)
    rows: list[SampleRow] = []
    for i in range(N):
        params = SamplingParams(temperature=temperature, seed=i)
        rows += [SampleRow(f"r{i}", params, [0], []), SampleRow(f"r{i}", params, [0], [draft])]
    logits = torch.stack([p0, p1]).repeat(N, 1)  # [2N, V]
    tokens, logprobs = sampler(logits, rows)
    out = accept_drafts(rows, tokens, logprobs, {f"r{i}": [draft] for i in range(N)})
    first = collections.Counter(t[0] for t in out.sampled.values())
    assert tv(first, N, q0) < TV_BOUND  # every first token: the target's distribution
    accepted = [t for t in out.sampled.values() if len(t) == 2]
    assert abs(len(accepted) / N - q0[draft]) < 0.015  # accepted with probability p(d)
    rejected = collections.Counter(t[0] for t in out.sampled.values() if len(t) == 1)
    residual = [0.0 if t == draft else p / (1 - q0[draft]) for t, p in enumerate(q0)]
    assert rejected[draft] == 0 and tv(rejected, sum(rejected.values()), residual) < TV_BOUND
    second = collections.Counter(t[1] for t in accepted)
    assert tv(second, len(accepted), q1) < 0.03  # fewer draws: P1 given the accepted draft

    # Seeded: each request's first token is the one it samples without a draft.
    plain = Sampler(len(P0), CPU)
    alone = [
        SampleRow(f"r{i}", SamplingParams(temperature=temperature, seed=i), [0], [])
        for i in range(N)
    ]
    tokens_alone, _ = plain(p0.repeat(N, 1), alone)
    assert [out.sampled[f"r{i}"][0] for i in range(N)] == tokens_alone
