"""CountedStream: a core's output stream that tells the router when its request is over, so that the
router's in-flight count per core (its load) is exact the moment a request ends, not a stats push later."""
from __future__ import annotations

from collections.abc import Callable

from server.engine.protocol.outputs import OutputStream, RequestOutput


class CountedStream:
    def __init__(self, stream: OutputStream, n: int, done: Callable[[], None]) -> None:
        self.request_id = stream.request_id
        self._stream = stream
        self._unfinished = n  # choices still running: the request is over when all n finished
        self._done: Callable[[], None] | None = done

    def __aiter__(self) -> "CountedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            out = await self._stream.__anext__()
        except BaseException:
            self._finish()
            raise
        self._unfinished -= out.finished
        if self._unfinished <= 0:
            self._finish()
        return out

    def abort(self) -> None:
        self._stream.abort()
        self._finish()

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._finish()

    def _finish(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()
