"""RequestStream: one accepted request's outputs as the front end iterates them, fed through a Sink
(a queue on the caller's event loop) by whichever side runs the engine: the step loop's thread in
this process (server.engine.async_engine) or the engine-core client's output thread
(server.engine.protocol.remote)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from server.engine.sequence import RequestOutput


class Aborts(Protocol):
    def abort(self, request_id: str) -> None: ...


@dataclass
class Sink:
    """Where one request's outputs go: a queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    unfinished: int = 1  # choices still running: the sink goes when the last one finishes

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more


class RequestStream:
    """An accepted request's outputs: per choice (`index`), cumulative, the last one `finished`.

    Iterate it; it ends once every one of the request's n choices has given
    its finished output. Closing it (or cancelling the iterating task) before
    the end aborts the request in the engine, which frees its KV blocks.
    Outputs are cumulative, so a consumer that fell behind gets only the
    newest one of each choice: one chunk carrying several tokens instead of a
    backlog of one-token chunks.
    """

    def __init__(self, engine: "Aborts", request_id: str, sink: Sink, n: int = 1) -> None:
        self.request_id = request_id
        self._engine = engine
        self._sink = sink
        self._unfinished = n
        self._pending: dict[int, RequestOutput] = {}  # choice index -> its newest undelivered output
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._pending:
            if self._done:
                raise StopAsyncIteration
            queue = self._sink.queue
            try:
                item = await queue.get()
            except BaseException:
                self.abort()  # cancelled while waiting: the consumer is gone
                raise
            while True:
                if isinstance(item, BaseException):
                    self._done = True
                    raise item
                # A choice's newer output replaces its older one, keeping its place in line.
                self._pending[item.index] = item
                self._unfinished -= item.finished
                if queue.empty():
                    break
                item = queue.get_nowait()
            self._done = self._unfinished == 0
        return self._pending.pop(next(iter(self._pending)))

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()


def dispatch(sinks: dict[str, Sink], outputs: Iterable[RequestOutput],
             finished: Callable[[str], None] | None = None) -> None:
    """Hand each output to its request's sink; a sink leaves `sinks` (and `finished` hears its request
    id) with its last choice's finished output. One wake-up per event loop per call, not one per
    request: each call_soon_threadsafe writes the loop's self-pipe, and with hundreds of streams that
    cost showed up."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
    for out in outputs:
        sink = sinks.get(out.request_id)
        if sink is None:
            continue
        if out.finished:
            sink.unfinished -= 1
            if sink.unfinished == 0:
                del sinks[out.request_id]
                if finished is not None:
                    finished(out.request_id)
        by_loop.setdefault(sink.loop, []).append((sink.queue, out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
