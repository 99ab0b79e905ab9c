"""Prompt lookup: the longest suffix found earlier wins, its latest occurrence, up to k tokens;
the index grows with the tokens and starts again when they change."""

from __future__ import annotations

import random

from loraplex.engine.request import Request
from loraplex.engine.spec.ngram import NgramProposer
from loraplex.sampling_params import SamplingParams


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The same rule by a plain scan: longest n, latest earlier occurrence."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_continues_the_passage_the_suffix_came_from() -> None:
    p = NgramProposer(2, 4)
    passage = [10, 11, 12, 13, 14, 15, 16]
    tokens = [1, *passage, 2, 3, 10, 11, 12]
    assert p.lookup("a", tokens, 3) == [13, 14, 15]
    assert p.lookup("a", tokens, 10) == [13, 14, 15, 16, 2, 3, 10, 11, 12]  # up to the end


def test_longest_suffix_wins_then_the_latest_occurrence() -> None:
    p = NgramProposer(1, 3)
    # "7 8" occurs twice (followed by 1, then 2); "6 7 8" once, followed by 1
    tokens = [6, 7, 8, 1, 5, 7, 8, 2, 6, 7, 8]
    assert p.lookup("a", tokens, 1) == [1]
    q = NgramProposer(1, 2)  # only "7 8": the latest occurrence, followed by 2
    assert q.lookup("b", tokens, 1) == [2]


def test_nothing_below_min_n_and_nothing_for_new_tokens() -> None:
    p = NgramProposer(2, 3)
    assert p.lookup("a", [1, 2, 3, 1], 4) == []  # only a 1-gram repeats
    assert p.lookup("b", [1, 2, 3, 4], 4) == []
    assert p.lookup("c", [1], 4) == []
    assert p.lookup("d", [1, 2, 1, 2], 0) == []


def test_the_suffix_itself_is_not_a_match() -> None:
    p = NgramProposer(2, 2)
    assert p.lookup("a", [1, 2], 2) == []
    assert p.lookup("b", [1, 2, 1, 2], 2) == [1, 2]  # the occurrence at 0..1, then 1 2


def test_incremental_index_matches_a_fresh_scan_as_tokens_grow_and_roll_back() -> None:
    rng = random.Random(0)
    p = NgramProposer(2, 4)
    tokens = [rng.randrange(6) for _ in range(5)]
    for step in range(400):
        if step % 97 == 96:
            del tokens[rng.randrange(1, len(tokens)) :]  # rolled back: the index starts again
        tokens += [rng.randrange(6) for _ in range(rng.randint(1, 3))]
        assert p.lookup("a", tokens, 3) == brute_force(tokens, 3, 2, 4), step


def test_propose_and_forget_by_request() -> None:
    p = NgramProposer(2, 2)
    a = Request("a", [1, 2, 3, 1, 2], SamplingParams())
    b = Request("b", [4, 5, 4], SamplingParams())
    assert p.propose([a, b], [2, 2]) == [[3, 1], []]
    p.forget(["a", "zzz"])
    assert p.propose([a], [1]) == [[3]]
