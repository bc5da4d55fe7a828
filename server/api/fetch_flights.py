"""Single flight for adapter fetches: concurrent first uses of one adapter share one fetch, and a
client that goes away does not cancel the fetch the others wait for. Fetches of different adapters
run side by side (each on a worker thread), so a request waits only for its own adapter."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class FetchFlights:
    """`max_concurrent` bounds the fetches under way at once: each runs Python code (signing, parsing,
    validation) that competes with the engine thread for the interpreter, so a storm of cold adapters
    must not take all of it."""

    def __init__(self, max_concurrent: int = 4) -> None:
        assert max_concurrent >= 1
        self._flights: dict[tuple[str, str], asyncio.Future] = {}
        self._slots: asyncio.Semaphore | None = None
        self._max = max_concurrent

    async def run(self, key: tuple[str, str], start: Callable[[], Awaitable[T]]) -> T:
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.ensure_future(self._bounded(start))
            self._flights[key] = flight
            flight.add_done_callback(lambda done: self._forget(key, done))
        return await asyncio.shield(flight)

    async def _bounded(self, start: Callable[[], Awaitable[T]]) -> T:
        if self._slots is None:  # made on the loop that uses it
            self._slots = asyncio.Semaphore(self._max)
        async with self._slots:
            return await start()

    def _forget(self, key: tuple[str, str], done: asyncio.Future) -> None:
        if self._flights.get(key) is done:
            del self._flights[key]
        if not done.cancelled():
            done.exception()  # retrieved: a flight every waiter left is not an "unretrieved" error

    def __len__(self) -> int:
        return len(self._flights)
