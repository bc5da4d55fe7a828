"""Single flight for adapter fetches: concurrent first uses of one adapter share one fetch, and a
client that goes away does not cancel the fetch the others wait for. Fetches of different adapters
run side by side (each on a worker thread, or in a loader process), so a request waits only for
its own adapter, and for its own tenant's other fetches beyond that tenant's bound."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class FetchFlights:
    """`max_concurrent` bounds the fetches under way at once (each takes a loader process, or runs
    Python code that competes with the engine thread for the interpreter); `per_tenant` bounds one
    owner's share of them, so one tenant's storm of cold adapters never holds every slot and another
    tenant's first use waits only for a free slot, not behind the storm."""

    def __init__(self, max_concurrent: int = 4, per_tenant: int | None = None) -> None:
        assert max_concurrent >= 1
        assert per_tenant is None or per_tenant >= 1
        self._flights: dict[tuple[str, str], asyncio.Future] = {}
        self._slots: asyncio.Semaphore | None = None
        self._max = max_concurrent
        self._per_tenant = per_tenant
        self._tenant_slots: dict[str, tuple[asyncio.Semaphore, int]] = {}  # owner -> (slots, flights using it)
        self.running: dict[str, int] = {}  # owner -> fetches under way now (past both bounds)

    async def run(self, key: tuple[str, str], start: Callable[[], Awaitable[T]]) -> T:
        """`key`: (owner, adapter name)."""
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.ensure_future(self._bounded(key[0], start))
            self._flights[key] = flight
            flight.add_done_callback(lambda done: self._forget(key, done))
        return await asyncio.shield(flight)

    async def _bounded(self, owner: str, start: Callable[[], Awaitable[T]]) -> T:
        if self._slots is None:  # made on the loop that uses it
            self._slots = asyncio.Semaphore(self._max)
        if self._per_tenant is None:
            async with self._slots:
                return await self._counted(owner, start)
        slots, users = self._tenant_slots.get(owner, (None, 0))
        slots = slots or asyncio.Semaphore(self._per_tenant)
        self._tenant_slots[owner] = (slots, users + 1)
        try:
            # The tenant's own slot first: waiting for it holds none of the shared ones.
            async with slots, self._slots:
                return await self._counted(owner, start)
        finally:
            slots, users = self._tenant_slots[owner]
            if users == 1:
                del self._tenant_slots[owner]  # forgotten when idle: thousands of tenants hold nothing
            else:
                self._tenant_slots[owner] = (slots, users - 1)

    async def _counted(self, owner: str, start: Callable[[], Awaitable[T]]) -> T:
        self.running[owner] = self.running.get(owner, 0) + 1
        try:
            return await start()
        finally:
            self.running[owner] -= 1
            if not self.running[owner]:
                del self.running[owner]

    def _forget(self, key: tuple[str, str], done: asyncio.Future) -> None:
        if self._flights.get(key) is done:
            del self._flights[key]
        if not done.cancelled():
            done.exception()  # retrieved: a flight every waiter left is not an "unretrieved" error

    def __len__(self) -> int:
        return len(self._flights)
