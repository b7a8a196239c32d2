"""Server-sent events: text deltas that never leak a stop string, and aborting on disconnect.

The engine reports the whole text so far after every step and applies stop strings itself (the
final text ends before the stop string). A stream must therefore hold back any tail that could
still become a stop string, or it would send characters the final text does not contain.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class TextDeltas:
    """Turns "text so far" snapshots into the increments a stream sends."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.sent = ""

    def _holdback(self, text: str) -> int:
        """Length of the longest tail of `text` that starts some stop string (or is an unfinished character)."""
        hold = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if stop.startswith(text[-k:]):
                    hold = k
                    break
        # A replacement character at the end is usually half of a multi-byte character.
        tail = len(text) - len(text.rstrip("\ufffd"))
        return max(hold, tail)

    def delta(self, text: str, finished: bool) -> str:
        safe = text if finished else text[: len(text) - self._holdback(text)]
        # Sent text cannot be taken back; if a re-decode changed earlier characters (rare, byte-level
        # tokenizers), only the part beyond what was sent goes out.
        out = safe[len(self.sent) :]
        self.sent += out
        return out


class AbortingStreamingResponse(StreamingResponse):
    """A `StreamingResponse` that calls `on_close` however the stream ends.

    Starlette cancels the streaming task when the client disconnects; the body generator may be
    suspended at a `yield` at that moment and would then only be closed by the garbage collector.
    Calling `on_close` here makes the abort (and the return of the request's KV pages) immediate.
    """

    def __init__(self, content: AsyncIterable[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
