"""SamplingParams: how one request is sampled and when it stops (shaped like vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

_MAX_LOGPROBS = 20


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
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0 (0 means greedy); got {self.temperature}")
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
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0; got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise bad("logprobs", f"must be between 0 and {_MAX_LOGPROBS}; got {self.logprobs}")
        stop = self.stop
        stops: tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise bad("stop", "must hold non-empty strings")
        ids = tuple(self.stop_token_ids or ())
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise bad("stop_token_ids", "must hold non-negative token ids")
        object.__setattr__(self, "stop_strings", stops)
        object.__setattr__(self, "stop_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_child(self, index: int) -> SamplingParams:
        """Params of the index-th of n samples: n=1, and a distinct seed when one is set."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
