"""What a draft-token proposer is to the engine (``spec/decoder.py`` calls it once per step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from loraplex.engine.request import Request


class Proposer(Protocol):
    """Proposes draft tokens to follow each request's known tokens."""

    name: str  # the config's method: the label of its metrics

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        """Up to ``num_drafts[i]`` (at least 1) tokens to follow ``requests[i].all_token_ids``,
        for each request; fewer, or none, where it has no good guess."""
        ...

    def forget(self, request_ids: list[str]) -> None:
        """These requests finished: drop what is kept for them."""
        ...
