"""A consumer that stops reading a RequestStream holds one output per choice, not a backlog: the engine's
thread keeps handing over cumulative outputs without waiting, and the consumer's next read gets the
newest of each choice (every token so far), then the end or the error."""
from __future__ import annotations

import asyncio
import threading

import pytest

from server.engine.async_engine import RequestStream, Sink, dispatch
from server.engine.protocol.errors import EngineDeadError
from server.engine.sequence import RequestOutput

pytestmark = pytest.mark.unit


class _Aborts:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _out(index: int, tokens: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [1, 2], list(range(tokens)), "", finished, "length" if finished else None, index=index)


def _feed(sinks: dict[str, Sink], steps: int, n: int, finish: bool) -> None:
    """As the engine's thread does: one dispatch per step, every choice, from another thread."""
    def run() -> None:
        for step in range(1, steps + 1):
            dispatch(sinks, [_out(i, step, finish and step == steps) for i in range(n)])
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def test_an_unread_stream_holds_the_newest_output_per_choice_only():
    async def main() -> None:
        sink = Sink(asyncio.get_running_loop(), 2)
        stream = RequestStream(_Aborts(), "r", sink, 2)
        sinks = {"r": sink}
        _feed(sinks, 5000, 2, finish=True)
        await asyncio.sleep(0)  # the loop runs the deliveries
        assert len(sink.pending) == 2  # not 10000 cumulative outputs
        got = [out async for out in stream]
        assert [(o.index, len(o.token_ids), o.finished) for o in got] == [(0, 5000, True), (1, 5000, True)]
        assert sinks == {}
    asyncio.run(main())


def test_an_error_comes_after_the_tokens_already_delivered():
    async def main() -> None:
        sink = Sink(asyncio.get_running_loop(), 1)
        stream = RequestStream(_Aborts(), "r", sink, 1)
        _feed({"r": sink}, 7, 1, finish=False)
        sink.put(EngineDeadError("gone"))
        await asyncio.sleep(0)
        first = await stream.__anext__()
        assert len(first.token_ids) == 7
        with pytest.raises(EngineDeadError):
            await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    asyncio.run(main())


def test_a_cancelled_reader_aborts_its_request():
    async def main() -> None:
        engine = _Aborts()
        stream = RequestStream(engine, "r", Sink(asyncio.get_running_loop(), 1), 1)
        task = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.aborted == ["r"]
    asyncio.run(main())
