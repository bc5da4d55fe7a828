"""Single flight for adapter fetches: concurrent first uses of one adapter share one fetch, and a
client that goes away does not cancel the fetch the others wait for. Fetches of different adapters
run side by side (each on a worker thread), so a request waits only for its own adapter."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class FetchFlights:
    def __init__(self) -> None:
        self._flights: dict[tuple[str, str], asyncio.Future] = {}

    async def run(self, key: tuple[str, str], start: Callable[[], Awaitable[T]]) -> T:
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.ensure_future(start())
            self._flights[key] = flight
            flight.add_done_callback(lambda done: self._forget(key, done))
        return await asyncio.shield(flight)

    def _forget(self, key: tuple[str, str], done: asyncio.Future) -> None:
        if self._flights.get(key) is done:
            del self._flights[key]
        if not done.cancelled():
            done.exception()  # retrieved: a flight every waiter left is not an "unretrieved" error

    def __len__(self) -> int:
        return len(self._flights)
