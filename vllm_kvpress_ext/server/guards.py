"""What keeps one bad request from costing anyone else: a body-size limit and contained 500s.

`BodySizeLimit` answers 413 before a large body is parsed (by `Content-Length`, or by counting a
chunked body as it arrives), so a 50 MB upload never reaches the JSON parser or the tokenizer. The
rest of the body is read and dropped (up to `DISCARD_BYTES`) before the answer goes out: a server that
closes while the client is still sending resets the connection, and a client that writes the whole
body before reading (httpx's AsyncClient, so the async openai SDK) then sees a `ReadError` instead
of the 413. Past `DISCARD_BYTES` the server answers at once and closes.

`GuardedRoute` turns an unexpected exception in a handler into a 500 with OpenAI's error shape
*inside* the route. Starlette's last-resort handler re-raises after answering, which makes the
server drop the keep-alive connection, so a client's next request on it would get a reset.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_kvpress_ext.api.errors import APIError, error_body

logger = logging.getLogger(__name__)


class _TooLarge(HTTPException):
    """Raised from `receive` once a streamed body passes the limit; FastAPI lets HTTPExceptions through."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body exceeds this server's limit of {max_bytes} bytes")


#: Bytes of an oversized body read and dropped so that its sender reads the 413 (see the module doc).
DISCARD_BYTES = 64 << 20


class BodySizeLimit:
    """ASGI middleware: HTTP requests whose body exceeds `max_bytes` get 413 and are never parsed."""

    def __init__(self, app: ASGIApp, max_bytes: int, discard_bytes: int = DISCARD_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.discard_bytes = discard_bytes

    def _message(self) -> str:
        return f"the request body exceeds this server's limit of {self.max_bytes} bytes"

    async def _discard_rest(self, receive: Receive, seen: int) -> bool:
        """Read and drop the rest of the body; False when the client left or the body passed `discard_bytes`."""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return False
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
            if seen > self.discard_bytes:
                return False

    async def _reject(self, send: Send, body_read: bool) -> None:
        body = json.dumps(error_body(self._message(), status=413)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if not body_read:
            headers.append((b"connection", b"close"))  # unread body bytes: the connection cannot be reused
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            body_read = int(declared) <= self.discard_bytes and await self._discard_rest(receive, 0)
            await self._reject(send, body_read)
            return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if not started:
                await self._reject(send, await self._discard_rest(receive, seen))


class GuardedRoute(APIRoute):
    """An `APIRoute` whose unexpected exceptions become a logged 500 instead of a dropped connection."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, HTTPException, RequestValidationError):
                raise  # answered by the app's handlers (or the size limit), connection intact
            except Exception as exc:
                logger.exception("unhandled error while serving %s", request.url.path)
                body: dict[str, Any] = error_body(f"internal error: {type(exc).__name__}", status=500)
                return JSONResponse(body, status_code=500)

        return guarded
