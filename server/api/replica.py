"""ReplicaHeader: names the replica on every response (`x-loraplex-replica`), so an operator
behind a load balancer, and the cluster tests, can see which process answered.

Pure ASGI on purpose: it edits only the `http.response.start` message and passes every body
message through as it comes, so SSE streams are never buffered (Starlette's BaseHTTPMiddleware
would put each response through a memory stream). Starlette keeps its ServerErrorMiddleware
outside all user middleware, so the one response without the header is the 500 sent for an
exception that no specific handler maps (that is, a bug).
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REPLICA_HEADER = "x-loraplex-replica"


class ReplicaHeader:
    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self._header = (REPLICA_HEADER.encode("latin-1"), replica.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._header]}
            await send(message)

        await self.app(scope, receive, send_named)
