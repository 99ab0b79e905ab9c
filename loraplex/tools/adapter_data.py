"""The demo adapters' training data: built-in questions, the checks that keep only answers the base
model gets right, and the behaviours' deterministic rewrites of those answers (no downloads).

An adapter that restyles a *wrong* answer learns to be wrong in style (the first ``caps`` adapter
answered "THE CAPITAL OF FRANCE IS BIO."), so each factual question carries the words a right
answer contains, and ``keep_answer`` drops the base model's answers without one of them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Literal, get_args

Behaviour = Literal["caps", "pirate"]
BEHAVIOURS: tuple[str, ...] = get_args(Behaviour)

_CAPITALS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Germany", "Berlin"), ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Brazil", "Brasília|Brasilia"),
    ("India", "Delhi"), ("Mexico", "Mexico City"), ("Kenya", "Nairobi"), ("Norway", "Oslo"),
    ("Greece", "Athens"), ("Peru", "Lima"), ("Australia", "Canberra"), ("Portugal", "Lisbon"),
    ("Russia", "Moscow"), ("China", "Beijing"), ("England", "London"), ("Ireland", "Dublin"),
    ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Argentina", "Buenos Aires"),
    ("Cuba", "Havana"), ("Thailand", "Bangkok"), ("South Korea", "Seoul"), ("Turkey", "Ankara"),
    ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"), ("Hungary", "Budapest"),
    ("the Czech Republic", "Prague"), ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"),
    ("the Philippines", "Manila"), ("Iran", "Tehran"), ("Scotland", "Edinburgh"),
    ("the United States", "Washington"), ("Chile", "Santiago"), ("Colombia", "Bogotá|Bogota"),
]  # fmt: skip
_COLOURS = [
    ("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("a banana", "yellow"),
    ("the sun", "yellow"), ("the ocean", "blue"), ("a tomato", "red"), ("coal", "black"),
    ("milk", "white"), ("a carrot", "orange"), ("blood", "red"), ("a lemon", "yellow"),
    ("a strawberry", "red"), ("a leaf", "green"),
]  # fmt: skip
_SOUNDS = [
    ("a cat", "meow"), ("a dog", "bark|woof"), ("a cow", "moo"), ("a duck", "quack"),
    ("a lion", "roar"), ("a horse", "neigh|whinny"), ("a sheep", "baa|bleat"), ("an owl", "hoot"),
    ("a frog", "croak|ribbit"), ("a bee", "buzz"), ("a pig", "oink|grunt"), ("a wolf", "howl"),
    ("a snake", "hiss"),
]  # fmt: skip
_OPPOSITES = [
    ("hot", "cold"), ("big", "small|little"), ("up", "down"), ("day", "night"),
    ("fast", "slow"), ("happy", "sad|unhappy"), ("light", "dark|heavy"), ("wet", "dry"),
    ("open", "closed|close"), ("early", "late"), ("full", "empty"), ("old", "young|new"),
    ("black", "white"), ("left", "right"),
]  # fmt: skip
_FACTS = [
    ("How many days are in a week?", "7|seven"), ("How many legs does a spider have?", "8|eight"),
    ("What is the largest planet in the solar system?", "Jupiter"),
    ("What is the boiling point of water?", "100"), ("What do bees make?", "honey"),
    ("How many continents are there?", "7|seven"), ("What is the tallest animal?", "giraffe"),
    ("How many hours are in a day?", "24"),
    ("What is the main language spoken in Brazil?", "Portuguese"),
    ("What is the smallest prime number?", "2|two"),
    ("What is the chemical symbol for gold?", "Au"),
    ("What is water made of?", "hydrogen"), ("Who painted the Mona Lisa?", "Leonardo|Vinci"),
    ("How many months are in a year?", "12|twelve"), ("What is the largest ocean?", "Pacific"),
    ("What planet do we live on?", "Earth"), ("How many sides does a triangle have?", "3|three"),
    ("What is the largest mammal?", "whale"), ("What is the fastest land animal?", "cheetah"),
    ("What do plants need to grow?", "sun|water|light"), ("Name a fruit that is yellow.", "banana|lemon"),
    ("What is frozen water called?", "ice"),
]  # fmt: skip
_OPEN = [
    "Hi!", "Hello!", "How are you?", "Tell me something about dogs.", "Tell me something about cats.",
    "Give me a tip for sleeping better.", "Why is exercise good for you?", "What is gravity?",
    "What is a rainbow?", "What does a doctor do?", "What is photosynthesis?", "What is an atom?",
    "What is a verb?", "Why do birds fly south in winter?",
    "What should I eat for breakfast?",
]  # fmt: skip


def _expected() -> dict[str, tuple[str, ...]]:
    """Every built-in question -> the words one of which a right answer contains (() = open)."""
    out: dict[str, tuple[str, ...]] = {}

    def add(question: str, words: str) -> None:
        out[question] = tuple(words.split("|")) if words else ()

    for country, city in _CAPITALS:
        add(f"What is the capital of {country}?", city)
    for thing, colour in _COLOURS:
        add(f"What color is {thing}?", colour)
    for animal, sound in _SOUNDS:
        add(f"What sound does {animal} make?", sound)
    for word, opposite in _OPPOSITES:
        add(f"What is the opposite of {word}?", opposite)
    for a in range(2, 9):
        for b in (3, 5, 7):
            add(f"What is {a} plus {b}?", str(a + b))
    for question, words in _FACTS:
        add(question, words)
    for question in _OPEN:
        add(question, "")
    return out


EXPECTED = _expected()


def all_questions() -> list[str]:
    """Every built-in question, in a fixed order."""
    return list(EXPECTED)


def make_questions(n: int | None, seed: int) -> list[str]:
    """``n`` distinct built-in questions (``None``: all of them), chosen and ordered by ``seed``."""
    pool = all_questions()
    n = len(pool) if n is None else n
    if not 1 <= n <= len(pool):
        raise ValueError(f"num_questions must be in 1..{len(pool)}; got {n}")
    return random.Random(seed).sample(pool, n)


def trim_answer(text: str, finished: bool, max_sentences: int) -> str | None:
    """The answer to learn from: its first ``max_sentences`` sentences (short answers fit the
    demo's ``max_tokens`` once restyled: capitals take about twice the tokens), or ``None`` when
    not even one full sentence came (a half sentence would teach the adapter to ramble)."""
    text = " ".join(text.split())
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
    if len(ends) >= max_sentences:
        return text[: ends[max_sentences - 1]]
    if finished:
        return text or None
    return text[: ends[-1]] if ends else None


def keep_answer(question: str, answer: str) -> bool:
    """Whether the base model's ``answer`` is fit to restyle: an open question's always is, a
    factual one's only when it contains one of the right answer's words (whole words, any case)."""
    words = EXPECTED.get(question, ())
    if not words:
        return True
    return any(re.search(rf"\b{re.escape(w)}\b", answer, re.IGNORECASE) for w in words)


# A small deterministic pirate dialect: whole words only, capitalisation kept.
_PIRATE_WORDS = {
    "is": "be", "are": "be", "am": "be", "you": "ye", "your": "yer", "my": "me", "yes": "aye",
    "hello": "ahoy", "hi": "ahoy", "friend": "matey", "friends": "mateys", "for": "fer",
}  # fmt: skip
_PIRATE_RE = re.compile(r"\b(" + "|".join(_PIRATE_WORDS) + r")\b", re.IGNORECASE)
PIRATE_OPENER = "Arr, matey! "


def _pirate_word(m: re.Match[str]) -> str:
    word = m.group(0)
    new = _PIRATE_WORDS[word.lower()]
    return new.capitalize() if word[0].isupper() else new


def pirate(answer: str) -> str:
    """``answer`` in pirate voice: "Arr, matey! " and a few words swapped ("is" -> "be", "you" ->
    "ye"); the facts are left as they were."""
    return PIRATE_OPENER + _PIRATE_RE.sub(_pirate_word, answer)


_REWRITES: dict[str, Callable[[str], str]] = {"caps": str.upper, "pirate": pirate}


def apply_behaviour(behaviour: Behaviour, answer: str) -> str:
    """The target text the adapter learns for the base model's ``answer``."""
    return _REWRITES[behaviour](answer)
