"""Responses that end the generation when the client goes away.

Starlette only notices a disconnect when a send fails; these watch for
`http.disconnect` while generating, so an abandoned request is aborted (and its
KV blocks freed) at once, and `on_close` always runs exactly once.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.types import Receive, Scope, Send


def sse_event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse:
    """text/event-stream of the byte chunks `events` yields; `on_close` settles the request."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for chunk in self._events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    await _wait_disconnect(receive)
                    tg.cancel_scope.cancel()
                tg.start_soon(watch)
                try:
                    await pump()
                except OSError:
                    pass  # the client went away mid-send
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
                await self._on_close()


async def until_disconnect(request: Request, work: Callable[[], Awaitable[object]]) -> tuple[bool, object]:
    """Run work() unless the client disconnects first: (completed, result)."""
    result: list[object] = []
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            await _wait_disconnect(request.receive)
            tg.cancel_scope.cancel()

        async def run() -> None:
            try:
                result.append(await work())
            except Exception as e:  # noqa: BLE001 - re-raised below, outside the task group
                errors.append(e)
            tg.cancel_scope.cancel()
        tg.start_soon(watch)
        tg.start_soon(run)
    if errors:
        raise errors[0]
    return (bool(result), result[0] if result else None)
