"""The host tier: parsed adapters in host memory under a byte budget, loaded in the background.

Loads run on worker threads (fetch from Redis + parse + pin); their results
are handed to the owning thread through a queue and inserted by `collect()`,
so every piece of tier state is touched by one thread only.

Eviction is LRU among unpinned entries. An entry is pinned while a request
that is running (or being admitted) uses it. LRU fits the power-law
popularity of real adapter traffic: popular adapters are touched every few
steps and stay; the long tail cycles through. Entries added without a source
to reload them from (offline `LLM.add_adapter`) are never evicted.

A load that finishes while every resident byte is pinned (or wanted by a
waiting request) is parked: kept aside, outside the budget, and inserted as
soon as room frees, rather than thrown away and fetched again every step. At
most `max_parked` loads are in flight or parked together (the scheduler
prefetches a window of that many adapters), so parked memory is bounded by
that many adapters, each no larger than the budget. An adapter that can never
fit fails its requests at once.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Collection

import torch

from adapters.format import LoraAdapter
from adapters.packed import PackedLoraAdapter, pack_adapter

Fetch = Callable[[str], LoraAdapter]  # version id -> parsed adapter (reads Redis); may raise


@dataclass
class HostTierStats:
    hits: int = 0
    misses: int = 0
    loads: int = 0
    load_failures: int = 0
    evictions: int = 0


@dataclass(frozen=True)
class HostTierSnapshot:
    adapters: int  # parsed adapters in host memory
    bytes_used: int
    budget_bytes: int | None
    hits: int
    misses: int
    loads: int
    load_failures: int
    evictions: int
    loading: int  # loads in flight
    parked: int  # loaded, waiting for unpinned room (outside the budget)
    parked_bytes: int


class HostTier:
    """`dtype`: the serving dtype adapters are kept in (adapters.packed); `pin_memory`: page-lock them;
    `init_thread`: run first on each loader thread (binds the engine's CUDA device); `prepare`: run on each
    packed adapter with its version id, on the loader threads for loads (the engine's DoRA scales:
    LoraSlots.prepare)."""

    def __init__(self, fetch: Fetch | None, budget_bytes: int | None, pin_memory: bool = False, workers: int = 2,
                 max_parked: int = 8, dtype: torch.dtype = torch.float32,
                 init_thread: Callable[[], None] | None = None,
                 prepare: Callable[[PackedLoraAdapter, str | None], PackedLoraAdapter] | None = None):
        self.fetch = fetch
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory
        self.dtype = dtype
        self.prepare = prepare
        self.entries: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.permanent: set[str] = set()
        self.pins: dict[str, int] = {}
        self.retiring: set[str] = set()  # removed while pinned: dropped at the last unpin
        self.loading: set[str] = set()
        self.parked: OrderedDict[str, tuple[LoraAdapter, float]] = OrderedDict()  # loaded, no room yet; oldest first
        self.unclaimed: set[str] = set()  # inserted by a load, not pinned since
        self.max_parked = max_parked
        self._unservable: dict[str, str] = {}  # failures found without a load, reported by the next collect()
        self.bytes_used = 0
        self.stats = HostTierStats()
        self.load_seconds: deque[float] = deque(maxlen=4096)  # recent load durations, drained by metrics
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="adapter-load",
                                        initializer=init_thread) if fetch else None
        self._wake = threading.Event()

    def wait_for_load(self, timeout: float) -> None:
        """Block until some load finishes (or `timeout`), so an engine with nothing else to do does not spin."""
        if self.loading and self._done.empty():
            self._wake.wait(timeout)
        self._wake.clear()

    # ---- queries ----
    def ready(self, version: str) -> bool:
        return version in self.entries

    def can_serve(self, version: str) -> bool:
        """Resident, being loaded (or parked), or loadable from the source."""
        return version in self.entries or version in self.loading or version in self.parked or self.fetch is not None

    @property
    def parked_bytes(self) -> int:
        return sum(adapter.size_bytes for adapter, _ in self.parked.values())

    def snapshot(self) -> HostTierSnapshot:
        """The tier's state and counters now (`stats` holds the live counters)."""
        s = self.stats
        return HostTierSnapshot(len(self.entries), self.bytes_used, self.budget_bytes, s.hits, s.misses, s.loads,
                                s.load_failures, s.evictions, len(self.loading), len(self.parked), self.parked_bytes)

    def get(self, version: str) -> LoraAdapter:
        self.entries.move_to_end(version)
        return self.entries[version]

    # ---- changes (owning thread only) ----
    def add(self, version: str, adapter: LoraAdapter) -> None:
        """A preloaded adapter: kept until removed, never evicted."""
        adapter = self.packed(adapter, version)
        self._drop(version)
        self.parked.pop(version, None)
        self.entries[version] = adapter
        self.permanent.add(version)
        self.bytes_used += adapter.size_bytes
        self.retiring.discard(version)

    def prefetch(self, version: str) -> None:
        """Start loading `version` unless it is resident, loading or parked (requests share one load)."""
        if version in self.entries or version in self.loading or version in self.parked:
            return
        if self._pool is None:
            # Removed while its request waited, and nothing can bring it back: fail, don't wait forever.
            self._unservable[version] = "it is not in host memory and there is no adapter source to load it from"
            return
        if len(self.loading) + len(self.parked) >= self.max_parked:
            return  # started when a place frees, so every finished load is sure of a parking place
        self.stats.misses += 1
        self.loading.add(version)
        self._pool.submit(self._load, version)

    def note_hit(self) -> None:
        self.stats.hits += 1

    def collect(self, wanted: Collection[str] = ()) -> dict[str, str]:
        """Insert parked and finished loads (evicting LRU entries for room), parking those that find no
        room; returns failed versions' errors. `wanted`: the versions waiting requests need.

        A failure is reported once, to the requests waiting then; a later request retries the load.
        """
        failed, self._unservable = self._unservable, {}
        # A load's entry that its waiting requests have not pinned yet is kept from eviction: evicting
        # it for another insert would make two waited-for adapters evict each other, each fetched again
        # and again. Only until first pinned, so popular adapters still age out by LRU and cannot
        # starve a parked one.
        keep = self.unclaimed & set(wanted)
        for version, (adapter, seconds) in list(self.parked.items()):
            del self.parked[version]
            self._place(version, adapter, seconds, failed, keep)
        while True:
            try:
                version, adapter, error, seconds = self._done.get_nowait()
            except queue.Empty:
                return failed
            self.loading.discard(version)
            if version in self.retiring:
                self.retiring.discard(version)
                continue  # removed while loading
            if error is not None:
                self.stats.load_failures += 1
                failed[version] = error
                continue
            self._place(version, adapter, seconds, failed, keep)

    def pin(self, version: str) -> None:
        self.pins[version] = self.pins.get(version, 0) + 1
        self.unclaimed.discard(version)

    def unpin(self, version: str) -> None:
        self.pins[version] -= 1
        if self.pins[version] == 0:
            del self.pins[version]
            if version in self.retiring:
                self.retiring.discard(version)
                self._drop(version)

    def remove(self, version: str) -> None:
        """Forget a deleted or replaced version: now, or when its last user finishes."""
        self.parked.pop(version, None)
        if self.pins.get(version) or version in self.loading:
            self.retiring.add(version)
            return
        self._drop(version)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def packed(self, adapter: LoraAdapter, version: str | None = None) -> PackedLoraAdapter:
        """`adapter` (of `version`, if a stored one) as this tier keeps it: one buffer in the serving dtype,
        pinned if asked."""
        if not (isinstance(adapter, PackedLoraAdapter) and adapter.flat.dtype == self.dtype and (
                adapter.flat.is_pinned() or not self.pin_memory)):
            adapter = pack_adapter(adapter, self.dtype, self.pin_memory)
        return adapter if self.prepare is None else self.prepare(adapter, version)

    # ---- internals ----
    def _drop(self, version: str) -> None:
        self.unclaimed.discard(version)
        adapter = self.entries.pop(version, None)
        if adapter is not None:
            self.bytes_used -= adapter.size_bytes
        self.permanent.discard(version)

    def _place(self, version: str, adapter: LoraAdapter, seconds: float, failed: dict[str, str],
               keep: set[str]) -> None:
        """Insert a loaded adapter, park it if every resident byte is pinned, or fail it if it can never fit."""
        if version in self.entries:
            return  # added (preloaded) while it loaded: that copy wins
        problem = self._never_fits(adapter.size_bytes)
        if problem is not None:
            self.stats.load_failures += 1
            failed[version] = problem
        elif self._make_room(adapter.size_bytes, keep):
            keep.add(version)
            self.unclaimed.add(version)
            self.entries[version] = adapter
            self.bytes_used += adapter.size_bytes
            self.stats.loads += 1
            self.load_seconds.append(seconds)
        else:
            assert len(self.parked) < self.max_parked, "prefetch bounds loads in flight plus parked"
            self.parked[version] = (adapter, seconds)

    def _never_fits(self, size: int) -> str | None:
        """Why an adapter of `size` bytes can never be resident, or None. Pins are temporary; these are not."""
        budget = self.budget_bytes
        if budget is None:
            return None
        if size > budget:
            return f"adapter needs {size} bytes, more than the host budget of {budget} bytes (--max-cpu-lora-bytes)"
        preloaded = sum(self.entries[v].size_bytes for v in self.permanent)
        if size > budget - preloaded:
            return (f"adapter needs {size} bytes, but preloaded adapters hold {preloaded} of the host budget "
                    f"of {budget} bytes (--max-cpu-lora-bytes)")
        return None

    def _make_room(self, size: int, keep: set[str]) -> bool:
        """Evict LRU entries (not pinned, preloaded or in `keep`) until `size` more bytes fit; evicts nothing
        when they cannot, so a parked load retried every step never empties the tier for nothing."""
        if self.budget_bytes is None:
            return True

        def evictable(version: str) -> bool:
            return version not in self.pins and version not in self.permanent and version not in keep

        spare = sum(a.size_bytes for v, a in self.entries.items() if evictable(v))
        if self.bytes_used - spare + size > self.budget_bytes:
            return False
        for version in list(self.entries):
            if self.bytes_used + size <= self.budget_bytes:
                break
            if not evictable(version):
                continue
            self._drop(version)
            self.stats.evictions += 1
        return self.bytes_used + size <= self.budget_bytes

    def _load(self, version: str) -> None:
        start = time.perf_counter()
        try:
            adapter = self.packed(self.fetch(version), version)
            self._done.put((version, adapter, None, time.perf_counter() - start))
        except Exception as exc:  # noqa: BLE001 - any failure is reported to the waiting requests
            self._done.put((version, None, f"{type(exc).__name__}: {exc}", 0.0))
        self._wake.set()

