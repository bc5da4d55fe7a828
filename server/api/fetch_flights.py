"""Single flight for adapter fetches: concurrent first uses of one adapter share one fetch, and a
client that goes away does not cancel the fetch the others wait for. Fetches of different adapters
run side by side (each on a worker thread, or in a loader process), so a request waits only for
its own adapter, and for its own tenant's other fetches beyond that tenant's share."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from server.tenant_share import TenantShare

T = TypeVar("T")

# Two lanes: a remote fetch (http, s3) may take a whole fetch timeout, drips included; a local
# directory is bounded by the disk. Each lane has its own slots, so a cold local load never
# waits behind remote fetches, however slow their sources.
REMOTE, NEAR = "remote", "near"


class FetchFlights:
    """`max_concurrent` bounds the remote fetches under way at once (each takes a loader process, or
    runs Python code that competes with the engine thread for the interpreter), `near_concurrent`
    the local ones; in each lane a tenant takes at most its share (server.tenant_share: an equal
    split among the tenants fetching, and at most `per_tenant`), waiting tenants in fair turns, so
    one tenant's storm of cold adapters never holds every slot."""

    def __init__(self, max_concurrent: int = 4, per_tenant: int | None = None, near_concurrent: int = 1) -> None:
        assert max_concurrent >= 1 and near_concurrent >= 1
        assert per_tenant is None or per_tenant >= 1
        self._flights: dict[tuple[str, str], asyncio.Future] = {}
        self._lanes = {REMOTE: TenantShare[asyncio.Future](max_concurrent, per_tenant),
                       NEAR: TenantShare[asyncio.Future](near_concurrent, per_tenant)}
        self.running: dict[str, int] = {}  # owner -> fetches under way now (holding a slot)

    async def run(self, key: tuple[str, str], start: Callable[[], Awaitable[T]], lane: str = REMOTE) -> T:
        """`key`: (owner, adapter name); `lane`: REMOTE or NEAR."""
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.ensure_future(self._bounded(key[0], start, self._lanes[lane]))
            self._flights[key] = flight
            flight.add_done_callback(lambda done: self._forget(key, done))
        return await asyncio.shield(flight)

    async def _bounded(self, owner: str, start: Callable[[], Awaitable[T]], share: TenantShare) -> T:
        turn = asyncio.get_running_loop().create_future()
        _wake(share.ask(owner, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if not share.cancel(turn):  # granted as it was cancelled: give the slot on
                _wake(share.release(owner))
            raise
        self.running[owner] = self.running.get(owner, 0) + 1
        try:
            return await start()
        finally:
            self.running[owner] -= 1
            if not self.running[owner]:
                del self.running[owner]
            _wake(share.release(owner))

    def _forget(self, key: tuple[str, str], done: asyncio.Future) -> None:
        if self._flights.get(key) is done:
            del self._flights[key]
        if not done.cancelled():
            done.exception()  # retrieved: a flight every waiter left is not an "unretrieved" error

    def __len__(self) -> int:
        return len(self._flights)


def _wake(turns: list[asyncio.Future]) -> None:
    for turn in turns:
        if not turn.done():
            turn.set_result(None)
