"""Prompt-lookup drafting (n-gram): continue a request's tokens the way they went on the last
time their current ending appeared before. Pure Python, no model.

    tokens   ... the quick brown fox jumps over ... the quick brown | ?
    suffix (n = 3)                                    quick brown    ^ now
    found    .......quick brown [fox jumps over]  ->  drafts: fox jumps over

The longest suffix of ``max_n`` down to ``min_n`` tokens that occurred earlier wins; among its
occurrences the latest one (the most recent context). Copy-heavy prompts (repeat, edit,
summarise, code edits) make long runs of drafts come true.

Each request keeps an index, per n, from every n-gram of its tokens to where its latest
occurrence ended; it grows by the tokens added since the last call, so a step costs
``O((new tokens) * (max_n - min_n + 1))`` for each request, not a scan of its context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from loraplex.engine.request import Request


@dataclass
class _Index:
    # maps[n - min_n]: n-gram -> end (exclusive) of its latest occurrence that ends before the
    # last token (so at least one token follows it)
    maps: list[dict[tuple[int, ...], int]]
    num_indexed: int = 0  # n-grams ending at positions <= this are in the maps
    tokens: list[int] = field(default_factory=list)  # the first num_indexed tokens (a copy)


class NgramProposer:
    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n; got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, _Index] = {}

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        return [
            self.lookup(r.request_id, r.all_token_ids, k)
            for r, k in zip(requests, num_drafts, strict=True)
        ]

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._indexes.pop(rid, None)

    def lookup(self, key: str, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens`` (the sequence kept under ``key``)."""
        if k < 1 or len(tokens) < self.min_n + 1:
            return []
        index = self._index(key, tokens)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            found = index.maps[n - self.min_n].get(tuple(tokens[end - n :]))
            if found is not None:
                return tokens[found : found + k]
        return []

    def _index(self, key: str, tokens: list[int]) -> _Index:
        """The request's index, grown to the n-grams ending before the last token."""
        index = self._indexes.get(key)
        seen = 0 if index is None else index.num_indexed
        # A sequence that is not the one indexed plus new tokens (rolled back): start again.
        if index is None or len(tokens) <= seen or tokens[:seen] != index.tokens:
            index = _Index(maps=[{} for _ in range(self.min_n, self.max_n + 1)])
            self._indexes[key] = index
            seen = 0
        last = len(tokens) - 1  # n-grams must end before it: the suffix itself is not a match
        for e in range(max(seen + 1, self.min_n), last + 1):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                index.maps[n - self.min_n][tuple(tokens[e - n : e])] = e
        index.num_indexed = last
        index.tokens = tokens[:last]
        return index
