"""The store tier's size: how many adapter versions Redis holds for this base's replicas, and their bytes.

Read from every owner's adapter index (two round trips per tenant), so at most once per TTL per replica
and never on the event loop; between counts /metrics and /admin/engine show the last one. Every replica
sees the same Redis: this is one number for the fleet, repeated per replica."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from adapters.registry import AdapterRegistry
from adapters.sharing import OPERATOR_OWNER
from tenants import TenantStore

TTL_S = 60.0


@dataclass(frozen=True)
class StoreTally:
    adapters: int  # current versions (each tenant's adapters and the operator's)
    bytes: int  # their stored size
    counted_at: float  # time.time() of the count


class StoreTallies:
    def __init__(self, registry: AdapterRegistry, tenants: TenantStore, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._registry = registry
        self._tenants = tenants
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()  # one count at a time; a scrape during it waits for its result
        self._last: StoreTally | None = None

    def get(self) -> StoreTally | None:
        """The last count, counted again if older than the TTL; while Redis fails, the last one (None before
        the first), so /metrics and /admin still answer. Blocking (Redis)."""
        with self._lock:
            if self._last is None or self._clock() - self._last.counted_at >= self._ttl_s:
                try:
                    owners = [t.id for t in self._tenants.list()] + [OPERATOR_OWNER]
                    records = [r for owner in owners for r in self._registry.list(owner)]
                except redis.RedisError:
                    return self._last
                self._last = StoreTally(len(records), sum(r.size_bytes for r in records), self._clock())
            return self._last
