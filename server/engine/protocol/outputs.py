"""What a submitted request streams back.

The output messages are the engine's own RequestOutput and TokenLogprobs: plain dataclass and
named-tuple fields (ids, text, floats), which a transport can carry as they are.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from server.engine.sequence import RequestOutput, TokenLogprobs

__all__ = ["OutputStream", "RequestOutput", "TokenLogprobs"]


class OutputStream(Protocol):
    """An accepted request's outputs: per choice (`index`), cumulative, each choice's last `finished`.
    A consumer that fell behind gets only the newest output of each choice. abort() (or aclose(), or
    cancelling the iterating task) ends the request in the engine and frees its KV blocks."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    def abort(self) -> None: ...

    async def aclose(self) -> None: ...
