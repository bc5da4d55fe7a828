"""Closing the connection on a response sent before its request's large body was received.

A refusal decided before the body is read (401, 429 at admission, 413 by Content-Length) or part
way through it (too many values, server.api.value_count) answers at once; but on a kept-alive
connection uvicorn then receives the rest of the body only to discard it (15 MB: ~240 chunks,
each through h11 on the event loop every other request waits on). With `Connection: close` it
closes the socket instead: the kernel resets the connection, and the client's upload stops at its
next write. HTTP clients read the response after a failed write (httpx/httpcore, curl, browsers),
so the refusal still arrives; a client that reads nothing until its body is sent gets a reset.

A body of at most SMALL_BODY_BYTES is left alone: uvicorn has it already, or will in one read, and
closing would only cost the client a new connection.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# uvicorn's read-ahead before it pauses reading (its HIGH_WATER_LIMIT): the most it buffers unasked.
SMALL_BODY_BYTES = 64 << 10
_CLOSE = (b"connection", b"close")


def _large_body(scope: Scope) -> bool:
    """The request declares a body over SMALL_BODY_BYTES, or one of unknown length (chunked)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return not value.isdigit() or int(value) > SMALL_BODY_BYTES
        if name == b"transfer-encoding":
            return True
    return False


class CloseUnreadBody:
    """Adds `Connection: close` to a response that starts before its request's large body was
    received whole. Pure ASGI (see server.api.response_headers): streamed responses pass unbuffered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _large_body(scope):
            await self.app(scope, receive, send)
            return
        received = False

        async def receive_tracked() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                received = True  # the last chunk, or the client is gone
            return message

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and not received:
                message = {**message, "headers": [*message.get("headers", ()), _CLOSE]}
            await send(message)

        await self.app(scope, receive_tracked, send_closing)
