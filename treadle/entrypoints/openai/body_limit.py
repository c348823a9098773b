"""Refuses request bodies over `--max-request-body-bytes` with 413, before the app reads them.

A declared Content-Length is checked before a byte of the body is read (the HTTP server never
hands the app more than was declared). A chunked body has no length up front, so it is read
here, up to the limit, and handed on whole. After the 413 the HTTP server discards the rest of
the body and keeps the connection, so a client that sends it all still reads the answer.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from treadle.entrypoints.openai.errors import error_response


class BodySizeLimitMiddleware:
    """Plain ASGI, like APIKeyMiddleware: streamed responses and disconnects pass through."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                await self._refuse(scope, receive, send, int(length))
                return
            await self.app(scope, receive, send)
        elif b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            first = await self._read_chunked(receive)
            if first is None:
                await self._refuse(scope, receive, send, None)
                return
            await self.app(scope, _replay(first, receive), send)
        else:
            await self.app(scope, receive, send)   # no body

    async def _read_chunked(self, receive: Receive) -> Message | None:
        """The whole body as one message (or the disconnect that cut it short); None once it
        passes the limit."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int | None) -> None:
        """`size`: the declared length; None for a chunked body cut off at the limit."""
        what = "request body is over" if size is None else f"request body is {size} bytes, over"
        response = error_response(413, f"{what} this server's limit of {self.max_bytes} bytes "
                                       "(treadle serve --max-request-body-bytes)")
        await response(scope, receive, send)


def _replay(first: Message, receive: Receive) -> Receive:
    """A receive that gives `first`, then what the connection gives (a disconnect)."""
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
