"""Engine logprobs (``TokenLogprobs``) in OpenAI's chat shape; JSON-safe numbers."""

from __future__ import annotations

import math
from collections.abc import Callable

from loraplex.engine.records import TokenLogprobs
from loraplex.platform.openai.protocol import ChatTokenLogprob, TopLogprob

_FLOOR = -9999.0  # what -inf (a token the sampler could never pick) is sent as, as vLLM does


def finite(logprob: float) -> float:
    """JSON has no -inf or NaN."""
    return logprob if math.isfinite(logprob) else _FLOOR


def chat_entry(entry: TokenLogprobs, text_of: Callable[[int], str]) -> ChatTokenLogprob:
    token = text_of(entry.token_id)
    return ChatTokenLogprob(
        token=token,
        logprob=finite(entry.logprob),
        bytes=list(token.encode("utf-8")),
        top_logprobs=[
            TopLogprob(token=(t := text_of(tid)), logprob=finite(v), bytes=list(t.encode("utf-8")))
            for tid, v in entry.top
        ],
    )
