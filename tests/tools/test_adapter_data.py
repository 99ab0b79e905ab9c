"""The demo adapters' training data: only right answers are kept, rewrites are deterministic and
leave the facts alone, answers are cut to whole sentences."""

from __future__ import annotations

import pytest

from loraplex.tools.adapter_data import (
    EXPECTED,
    apply_behaviour,
    keep_answer,
    make_questions,
    pirate,
    trim_answer,
)


def test_wrong_answers_are_dropped_and_open_questions_kept() -> None:
    q = "What is the capital of France?"
    assert keep_answer(q, "The capital of France is Paris.")
    assert not keep_answer(q, "The capital of France is Bio.")
    assert not keep_answer("What is 2 plus 5?", "2 + 5 = 8")
    assert keep_answer("What is 2 plus 5?", "2 + 5 = 7.")
    assert not keep_answer("What is 2 plus 5?", "2 + 5 = 17.")  # whole words only
    assert keep_answer("What is the capital of Brazil?", "It is Brasília.")
    assert keep_answer("Hi!", "anything")
    assert all(words or q.endswith(("!", "?", ".")) for q, words in EXPECTED.items())


def test_rewrites_keep_the_facts() -> None:
    assert (
        pirate("The capital of France is Paris.") == "Arr, matey! The capital of France be Paris."
    )
    assert pirate("Hello! Are you my friend?") == "Arr, matey! Ahoy! Be ye me matey?"
    assert pirate("This island is nice.") == "Arr, matey! This island be nice."  # whole words
    assert apply_behaviour("caps", "Paris is big.") == "PARIS IS BIG."


@pytest.mark.parametrize(
    ("text", "finished", "want"),
    [
        ("A week has 7 days. It starts on Monday.", True, "A week has 7 days."),
        ("It is 100°C (212°F). More", False, "It is 100°C (212°F)."),
        ("Water boils at 100.5 degrees and", False, None),  # no full sentence: dropped
        ("2 + 3 = 5", True, "2 + 3 = 5"),
    ],
)
def test_answers_are_cut_to_whole_sentences(text: str, finished: bool, want: str | None) -> None:
    assert trim_answer(text, finished, max_sentences=1) == want


def test_questions_are_seeded_and_bounded() -> None:
    assert make_questions(8, 0) == make_questions(8, 0) != make_questions(8, 1)
    assert sorted(make_questions(None, 0)) == sorted(EXPECTED)
    with pytest.raises(ValueError, match="num_questions"):
        make_questions(0, 0)
