"""RequestStream: one accepted request's outputs as the front end iterates them, fed through a Sink
(one slot per choice on the caller's event loop) by whichever side runs the engine: the step loop's
thread in this process (server.engine.async_engine) or the engine-core client's output thread
(server.engine.protocol.remote).

Backpressure: outputs are cumulative, so a Sink keeps only each choice's newest undelivered output,
never a backlog. A consumer that stops reading (an SSE client that stopped reading its socket blocks
its route's writes, and with them its reads here) holds at most one output per choice and the
engine's error: it can neither grow the front end's memory nor slow the engine or other streams; the
request runs on to its end (or its max_tokens) and whatever the client reads later carries every
token up to then in one chunk.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from server.engine.sequence import RequestOutput


class Aborts(Protocol):
    def abort(self, request_id: str) -> None: ...


@dataclass
class Sink:
    """Where one request's outputs go, on the caller's event loop: its choices' newest undelivered
    outputs (in the order their choices first arrived) and the error that ended it, if any."""

    loop: asyncio.AbstractEventLoop
    unfinished: int = 1  # choices still running: the sink goes when the last one finishes
    pending: dict[int, RequestOutput] = field(default_factory=dict)
    error: BaseException | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def offer(self, item: RequestOutput | BaseException) -> None:
        """On the loop's thread. A choice's newer output replaces its older one, keeping its place."""
        if isinstance(item, BaseException):
            self.error = item
        elif self.error is None:
            self.pending[item.index] = item
        self.ready.set()

    def put(self, item: RequestOutput | BaseException) -> None:
        """From any thread."""
        try:
            self.loop.call_soon_threadsafe(self.offer, item)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more

    async def take(self) -> list[RequestOutput]:
        """Every pending output, oldest choice first; the error once none is pending."""
        while not self.pending and self.error is None:
            self.ready.clear()
            await self.ready.wait()
        if not self.pending:
            raise self.error
        taken, self.pending = list(self.pending.values()), {}
        return taken


class RequestStream:
    """An accepted request's outputs: per choice (`index`), cumulative, the last one `finished`.

    Iterate it; it ends once every one of the request's n choices has given
    its finished output. Closing it (or cancelling the iterating task) before
    the end aborts the request in the engine, which frees its KV blocks.
    Outputs are cumulative, so a consumer that fell behind gets only the
    newest one of each choice: one chunk carrying several tokens instead of a
    backlog of one-token chunks (the Sink never holds more).
    """

    def __init__(self, engine: "Aborts", request_id: str, sink: Sink, n: int = 1) -> None:
        self.request_id = request_id
        self._engine = engine
        self._sink = sink
        self._unfinished = n
        self._pending: list[RequestOutput] = []
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._pending:
            if self._done:
                raise StopAsyncIteration
            try:
                self._pending = await self._sink.take()
            except asyncio.CancelledError:
                self.abort()  # cancelled while waiting: the consumer is gone
                raise
            except BaseException:
                self._done = True
                raise
            self._unfinished -= sum(out.finished for out in self._pending)
            self._done = self._unfinished == 0
        return self._pending.pop(0)

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
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, RequestOutput]]] = {}
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
        by_loop.setdefault(sink.loop, []).append((sink, out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more


def _deliver(items: list[tuple[Sink, RequestOutput]]) -> None:
    for sink, out in items:
        sink.offer(out)
