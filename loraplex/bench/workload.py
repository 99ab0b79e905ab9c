"""Synthetic, seeded benchmark workloads: no dataset download, identical for every system.

Prompts are 20–60 words of plain English drawn from a fixed sentence pool; each request has its
own output length, uniform in ``[min_output, max_output]``, generated greedily with EOS ignored so
that every system produces exactly the same number of tokens per request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

SENTENCES: tuple[str, ...] = (
    "The old lighthouse keeper climbed the stairs every evening to light the lamp.",
    "Rain fell softly on the roof while the children read their books by the fire.",
    "A small boat drifted across the quiet lake as the sun began to set.",
    "Scientists measured the temperature of the ocean at many different depths.",
    "The market was full of fresh bread, ripe fruit and the voices of traders.",
    "She wrote a long letter to her brother about the mountains she had crossed.",
    "Engineers tested the new bridge with heavy trucks before it opened to traffic.",
    "The library kept maps of the city drawn more than two hundred years ago.",
    "After the storm, the farmers walked through the fields to count the damage.",
    "A young musician practiced the same difficult passage until it sounded easy.",
    "The train left the station on time and crossed the river before noon.",
    "Bees moved from flower to flower in the warm light of the afternoon.",
    "The teacher asked the class to explain why the moon changes its shape.",
    "Our neighbors planted tomatoes, beans and sunflowers along the garden wall.",
    "The museum opened a new room for paintings of ships and distant harbors.",
    "He repaired the clock slowly, cleaning each gear with a tiny brush.",
    "Snow covered the valley, and the village was silent except for the bells.",
    "The committee met on Tuesday to discuss the budget for the next year.",
    "A fox crossed the road at dawn and disappeared into the tall grass.",
    "The cook added salt, pepper and a little lemon juice to the soup.",
    "Travelers waited at the border while the guards checked every passport.",
    "The students built a simple radio from wire, a battery and an old speaker.",
    "Clouds gathered over the hills, promising rain before the end of the day.",
    "The captain studied the charts and chose a safer route around the islands.",
    "Every morning the baker opened the shop before the streets were awake.",
    "The hikers followed the river upstream until they reached a narrow canyon.",
    "A new law changed how the city collected and recycled its waste.",
    "The painter mixed blue and yellow to find the exact green of the forest.",
    "Children ran along the beach, chasing the waves and collecting shells.",
    "The doctor listened carefully and then explained the treatment in plain words.",
    "An old map showed a road that no longer existed through the northern woods.",
    "The orchestra tuned their instruments while the audience found their seats.",
)


@dataclass(frozen=True)
class Workload:
    prompts: list[str]
    output_lens: list[int]
    seed: int

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError("a workload needs one output length per prompt")

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def random_text(rng: random.Random, num_words: int) -> str:
    """``num_words`` words of running text: sentences from the pool, cut at exactly that count.

    The text starts at a random word of its first sentence, so that two prompts rarely share a
    whole first KV block (which would let prefix caching skip work the baseline has to do).
    """
    first = rng.choice(SENTENCES).split()
    words: list[str] = first[rng.randrange(len(first)) :]
    while len(words) < num_words:
        words.extend(rng.choice(SENTENCES).split())
    return " ".join(words[:num_words])


def make_workload(
    num_requests: int,
    min_output: int,
    max_output: int,
    *,
    min_words: int = 20,
    max_words: int = 60,
    seed: int = 0,
) -> Workload:
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1; got {num_requests}")
    if not 1 <= min_output <= max_output:
        raise ValueError(
            f"output lengths need 1 <= min_output <= max_output; got {min_output}..{max_output}"
        )
    if not 1 <= min_words <= max_words:
        raise ValueError(f"prompt words need 1 <= min <= max; got {min_words}..{max_words}")
    rng = random.Random(seed)
    prompts = [random_text(rng, rng.randint(min_words, max_words)) for _ in range(num_requests)]
    output_lens = [rng.randint(min_output, max_output) for _ in range(num_requests)]
    return Workload(prompts=prompts, output_lens=output_lens, seed=seed)


def encode(tokenizer: Any, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of ``text``: plain (no special tokens added) or as one user turn of the chat."""
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(text).input_ids)


def shared_prefix_ids(tokenizer: Any, num_tokens: int, seed: int) -> list[int]:
    """Exactly ``num_tokens`` ids of running text (the shared document of the prefix test)."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids.extend(encode(tokenizer, random_text(rng, 200)))
    return ids[:num_tokens]
