"""Verification of draft tokens: which of a request's drafts the target model accepts.

A request with drafts ``d_1 .. d_k`` is computed as ``[t, d_1, .., d_k]`` (``t`` its last
token) in the flat batch, and the sampler draws one token from each of those ``1 + k`` rows,
row ``j`` with the context ``output + d_1 .. d_j`` (penalties and seeds see exactly what they
would see without speculation)::

    row        0      1      2     ..   k
    context    t      d_1    d_2        d_k
    sampled    s_0    s_1    s_2        s_k        s_j ~ p_j, the target's distribution
    accepted   s_0 == d_1, s_1 == d_2, ... while equal; the first s_j that differs is kept

The step emits ``s_0 .. s_a`` where ``a`` is the number of drafts accepted: every accepted draft
(``s_j == d_{j+1}``) and one more token, the correction at the first mismatch or the bonus
``s_k`` when all are accepted.

Greedy rows: ``s_j`` is the target's argmax, so the output is token for token what decoding
one position per step gives.

Sampled rows: this is Leviathan et al.'s (2023) rejection sampling for a draft distribution
that is a point mass ``q = δ(d)`` (both proposers draft deterministically: prompt lookup, and
the draft model's argmax). Their rule accepts ``d`` with probability ``min(1, p(d) / q(d)) =
p(d)`` and, on rejection, samples from ``norm(max(0, p - q))``: ``p`` with ``d``'s mass removed,
renormalised. Drawing ``s ~ p`` and accepting iff ``s == d`` does exactly that: ``P(accept) =
P(s = d) = p(d)``, and given a rejection ``s`` is distributed as ``p`` conditioned on ``s != d``,
which is ``p(x) / (1 - p(d))`` for ``x != d``. So each emitted token is distributed as the target
says, and a request seeded ``seed`` draws its noise per output position (``Sampler``): its
tokens are the very tokens it samples without speculation.

The rows after a rejection are discarded (their contexts held a rejected draft).
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.engine.records import RunnerOutput, ScheduledRequest, TokenLogprobs
from loraplex.engine.sampler import SampleRow


def num_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many drafts the rows' tokens accept: the length of the longest prefix of
    ``drafts`` equal to ``sampled`` (``len(sampled) == len(drafts) + 1``)."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(
            f"verification needs one sampled token per draft plus one; got {len(sampled)} "
            f"for {len(drafts)} drafts"
        )
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a


def verification_rows(r: ScheduledRequest) -> list[SampleRow]:
    """The sample rows of a request: one, or ``1 + k`` with ``k`` drafts, row ``j`` seeing the
    output so far followed by the first ``j`` drafts."""
    rows = [SampleRow(r.request_id, r.params, r.prompt_token_ids, r.output_token_ids)]
    drafts = r.draft_token_ids
    for j in range(1, len(drafts) + 1):
        context = [*r.output_token_ids, *drafts[:j]]
        rows.append(SampleRow(r.request_id, r.params, r.prompt_token_ids, context))
    return rows


def accept_drafts(
    rows: Sequence[SampleRow],
    tokens: Sequence[int],
    logprobs: Sequence[TokenLogprobs | None],
    drafts: dict[str, list[int]],
) -> RunnerOutput:
    """The step's ``RunnerOutput`` from the sampler's tokens of ``rows``, where the rows of a
    request with drafts (``drafts``: request id -> its drafts) are consecutive, as
    ``verification_rows`` made them: each request gets the tokens ``num_accepted`` keeps."""
    sampled: dict[str, list[int]] = {}
    lps: dict[str, list[TokenLogprobs]] = {}
    i = 0
    while i < len(rows):
        rid = rows[i].request_id
        d = drafts.get(rid)
        n = 1 if not d else num_accepted(d, tokens[i : i + len(d) + 1]) + 1
        sampled[rid] = list(tokens[i : i + n])
        kept = [lp for lp in logprobs[i : i + n] if lp is not None]
        if kept:
            lps[rid] = kept
        i += 1 + len(d or ())
    return RunnerOutput(sampled=sampled, logprobs=lps)
