"""ASGI middleware: a request-body size limit (413 before the app sees the body) and request counting."""
from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.server.errors import error_response

CLIENT_CLOSED = 499  # nginx's "client closed request": not a server error
TOO_LARGE, GONE = object(), object()


class RequestGuard:
    """Buffers each request body up to max_body_bytes (declared or streamed, chunked too), answering 413
    as soon as it is over and closing the connection rather than reading the rest, and reports (path,
    status) of every HTTP response to on_response (499 for a client gone before its answer)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, on_response: Callable[[str, int], None]):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_response = on_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            body = await self._read_body(scope, receive)
            if body is TOO_LARGE:
                too_large = error_response(413, f"request body is larger than {self.max_body_bytes} bytes",
                                           code="request_too_large", headers={"Connection": "close"})
                await too_large(scope, receive, send_counted)
            elif body is GONE:
                status = CLIENT_CLOSED
            else:
                await self.app(scope, _replay(body, receive), send_counted)
        finally:
            self.on_response(scope["path"], status)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | object:
        """The whole body; TOO_LARGE once it is over the limit; GONE if the client left meanwhile."""
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                return TOO_LARGE
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return GONE
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return TOO_LARGE
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """Hands the buffered body to the app once, then the real channel (for disconnect notices)."""
    delivered = False

    async def replayed() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
