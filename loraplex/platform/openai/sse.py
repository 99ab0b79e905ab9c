"""Server-sent events: ``data: {json}\\n\\n`` chunks ending with ``data: [DONE]``, and a streaming
response that notices a client that went away even while no token is being sent."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse(data: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    """Streams ``events``; when the client disconnects, the stream is cancelled at once and
    ``events`` closed (its ``finally`` blocks abort the engine request) before this returns.

    Starlette's own ``StreamingResponse`` only notices a disconnect on its next ``send`` under
    ASGI spec 2.4 and leaves the iterator to the garbage collector; here a listener task
    watches ``receive`` for ``http.disconnect`` whatever the spec version.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: Mapping[str, str] | None = None):
        super().__init__(
            events,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client left while we sent
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
