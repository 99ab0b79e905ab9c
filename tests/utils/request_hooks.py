"""Checks that quotas and usage are wired into the request path, and an engine token counter.

``count_engine_tokens(fake)`` counts, per tenant cache salt, the tokens the fake engine actually
handed to the platform (what usage must add up to).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from loraplex.engine.client import RequestDelta
from tests.utils.fakes import FakeEngineClient


def wire(env: Any) -> None:
    """Assert that quotas and usage sit on the request path: the serving layer admits each
    request through the platform's quotas (``OpenAIServing._admit``), and the request log's
    observers finish the quota lease and record usage when the request ends."""
    app = env.app
    observers = app.platform.observers
    assert app.platform.tenancy.quotas.observe in observers, "the quotas do not observe requests"
    assert app.platform.tenancy.usage.observe in observers, "the usage does not observe requests"
    assert callable(getattr(app.platform.serving, "_admit", None)), "serving does not admit"


def count_engine_tokens(fake: FakeEngineClient) -> tuple[Counter[str], Counter[str]]:
    """(completion tokens, prompt tokens) handed out by ``fake``, by the requests' cache salt
    (``salt:<tenant cache salt>``, or "" for none)."""
    produced: Counter[str] = Counter()
    prompts: Counter[str] = Counter()
    generate = fake.generate

    def counting(
        request_id: str, prompt_token_ids: list[int], params: Any, **kw: Any
    ) -> AsyncIterator[RequestDelta]:
        stream = generate(request_id, prompt_token_ids, params, **kw)
        salt = ",".join(kw.get("cache_extra_keys") or ())
        prompts[salt] += len(prompt_token_ids)  # the platform counts a prompt once submitted

        async def run() -> AsyncIterator[RequestDelta]:
            async with contextlib.aclosing(stream) as deltas:  # type: ignore[type-var]
                async for delta in deltas:
                    produced[salt] += len(delta.new_token_ids)
                    yield delta

        return run()

    fake.generate = counting  # type: ignore[method-assign]
    return produced, prompts
