"""TenantShare: who takes the next of a few shared slots (loader processes, compile processes), so
that no tenant holds more than its share while another waits.

A tenant's share is ceil(capacity / active tenants) (active: holding a slot or waiting for one),
and at most `most` if the operator bounds it. A freed slot goes to the waiting tenant that holds
the fewest, then to whoever has waited longest: a tenant flooding the queue gets its turn after
each other tenant's, never all of them. A tenant over its share keeps the slots it holds (a load
or compile is not interrupted) but gets no new one until it is back under.

Bookkeeping only: the caller holds its own lock (or runs on one event loop) and wakes the waiters
that ask() and release() hand back.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Hashable
from typing import Generic, TypeVar

W = TypeVar("W", bound=Hashable)


class TenantShare(Generic[W]):
    def __init__(self, capacity: int, most: int | None = None) -> None:
        assert capacity >= 1 and (most is None or most >= 1)
        self.capacity = capacity
        self._most = most
        self.held: dict[str, int] = {}            # owner -> slots it holds now
        self._waiting: dict[W, tuple[int, str]] = {}  # waiter -> (arrival, owner), in arrival order
        self._arrivals = itertools.count()

    def share(self) -> int:
        """The most slots one tenant may take now."""
        active = len(set(self.held) | {owner for _, owner in self._waiting.values()})
        cap = math.ceil(self.capacity / max(1, active))
        return cap if self._most is None else min(cap, self._most)

    def ask(self, owner: str, waiter: W) -> list[W]:
        """Queue `waiter` for a slot of `owner`; the waiters granted a slot now (maybe this one)."""
        self._waiting[waiter] = (next(self._arrivals), owner)
        return self._grant()

    def cancel(self, waiter: W) -> bool:
        """Take a waiter out of the queue: False if it was granted already (its slot must be released)."""
        return self._waiting.pop(waiter, None) is not None

    def release(self, owner: str) -> list[W]:
        """`owner` gives a slot back; the waiters granted one now."""
        left = self.held[owner] - 1
        if left:
            self.held[owner] = left
        else:
            del self.held[owner]  # forgotten when idle: thousands of tenants hold nothing
        return self._grant()

    def _grant(self) -> list[W]:
        granted: list[W] = []
        while self._waiting and sum(self.held.values()) < self.capacity:
            cap = self.share()
            eligible = [(self.held.get(owner, 0), arrival, waiter, owner)
                        for waiter, (arrival, owner) in self._waiting.items() if self.held.get(owner, 0) < cap]
            if not eligible:
                break
            _, _, waiter, owner = min(eligible, key=lambda e: e[:2])
            del self._waiting[waiter]
            self.held[owner] = self.held.get(owner, 0) + 1
            granted.append(waiter)
        return granted
