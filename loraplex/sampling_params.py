"""SamplingParams: how one request is sampled and when it stops (shaped like vLLM's)."""

from __future__ import annotations

import json as _json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

_MAX_LOGPROBS = 20


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (shaped like vLLM's): exactly one of ``json``
    (a JSON schema, as a mapping or its JSON text), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (one of these strings) or ``grammar`` (a Lark grammar in llguidance's
    dialect, which may embed JSON schemas with ``%json {...}``).

    ``disable_any_whitespace``: JSON without free whitespace between tokens (compact output)."""

    json: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}"
            )
        if isinstance(self.choice, str):
            raise ValueError("StructuredOutputsParams.choice must be a list of strings, not one")
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice must be non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                parsed = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from e
            object.__setattr__(self, "json", parsed)
        if self.json is not None and not isinstance(self.json, Mapping | bool):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema (an object)")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def key(self) -> str:
        """A canonical text of the constraint: equal constraints, equal keys (the compile
        cache's key)."""
        value: Any = getattr(self, self.kind) if self.kind != "json_object" else True
        if isinstance(value, tuple):
            value = list(value)
        return _json.dumps(
            [self.kind, value, self.disable_any_whitespace], sort_keys=True, separators=(",", ":")
        )


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: until the context is full
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0 = only the sampled one)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, default=())
    stop_ids: tuple[int, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1; got {self.n!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", f"must be an integer >= 1; got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad(
                "temperature",
                f"must be a finite number >= 0 (0 means greedy); got {self.temperature}",
            )
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1]; got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1 or 0 (off) or a positive integer; got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1]; got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2]; got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2]; got {self.frequency_penalty}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise bad(
                "repetition_penalty", f"must be a finite number > 0; got {self.repetition_penalty}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise bad("logprobs", f"must be between 0 and {_MAX_LOGPROBS}; got {self.logprobs}")
        stop = self.stop
        stops: tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise bad("stop", "must hold non-empty strings")
        ids = tuple(self.stop_token_ids or ())
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise bad("stop_token_ids", "must hold non-negative token ids")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        object.__setattr__(self, "stop_strings", stops)
        object.__setattr__(self, "stop_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_child(self, index: int) -> SamplingParams:
        """Params of the index-th of n samples: n=1, and a distinct seed when one is set."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
