"""The host tier: parsed adapters in host memory under a byte budget, loaded in the background.

Loads run on worker threads (fetch from Redis + parse + pin); their results
are handed to the owning thread through a queue and inserted by `collect()`,
so every piece of tier state is touched by one thread only.

Eviction is LRU among unpinned entries. An entry is pinned while a request
that is running (or being admitted) uses it. LRU fits the power-law
popularity of real adapter traffic: popular adapters are touched every few
steps and stay; the long tail cycles through. Entries added without a source
to reload them from (offline `LLM.add_adapter`) are never evicted.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from adapters.format import LoraAdapter, LoraWeights

Fetch = Callable[[str], LoraAdapter]  # version id -> parsed adapter (reads Redis); may raise


@dataclass
class HostTierStats:
    hits: int = 0
    misses: int = 0
    loads: int = 0
    load_failures: int = 0
    evictions: int = 0


class HostTier:
    def __init__(self, fetch: Fetch | None, budget_bytes: int | None, pin_memory: bool = False, workers: int = 2):
        self.fetch = fetch
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory
        self.entries: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.permanent: set[str] = set()
        self.pins: dict[str, int] = {}
        self.retiring: set[str] = set()  # removed while pinned: dropped at the last unpin
        self.loading: set[str] = set()
        self.bytes_used = 0
        self.stats = HostTierStats()
        self.load_seconds: deque[float] = deque(maxlen=4096)  # recent load durations, drained by metrics
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="adapter-load") if fetch else None
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
        """Resident, being loaded, or loadable from the source."""
        return version in self.entries or version in self.loading or self.fetch is not None

    def get(self, version: str) -> LoraAdapter:
        self.entries.move_to_end(version)
        return self.entries[version]

    # ---- changes (owning thread only) ----
    def add(self, version: str, adapter: LoraAdapter) -> None:
        """A preloaded adapter: kept until removed, never evicted."""
        self._drop(version)
        self.entries[version] = adapter
        self.permanent.add(version)
        self.bytes_used += adapter.size_bytes
        self.retiring.discard(version)

    def prefetch(self, version: str) -> None:
        """Start loading `version` unless it is resident or already loading (requests share one load)."""
        if version in self.entries or version in self.loading or self._pool is None:
            return
        self.stats.misses += 1
        self.loading.add(version)
        self._pool.submit(self._load, version)

    def note_hit(self) -> None:
        self.stats.hits += 1

    def collect(self) -> dict[str, str]:
        """Insert finished loads (evicting LRU unpinned entries for room); returns failed versions' errors.

        A failure is reported once, to the requests waiting then; a later request retries the load.
        """
        failed: dict[str, str] = {}
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
            if self._make_room(adapter.size_bytes):
                self.entries[version] = adapter
                self.bytes_used += adapter.size_bytes
                self.stats.loads += 1
                self.load_seconds.append(seconds)
            # else: every resident byte is pinned; the waiting request asks again next step.

    def pin(self, version: str) -> None:
        self.pins[version] = self.pins.get(version, 0) + 1

    def unpin(self, version: str) -> None:
        self.pins[version] -= 1
        if self.pins[version] == 0:
            del self.pins[version]
            if version in self.retiring:
                self.retiring.discard(version)
                self._drop(version)

    def remove(self, version: str) -> None:
        """Forget a deleted or replaced version: now, or when its last user finishes."""
        if self.pins.get(version) or version in self.loading:
            self.retiring.add(version)
            return
        self._drop(version)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals ----
    def _drop(self, version: str) -> None:
        adapter = self.entries.pop(version, None)
        if adapter is not None:
            self.bytes_used -= adapter.size_bytes
        self.permanent.discard(version)

    def _make_room(self, size: int) -> bool:
        if self.budget_bytes is None:
            return True
        if size > self.budget_bytes:
            return False
        for version in list(self.entries):
            if self.bytes_used + size <= self.budget_bytes:
                break
            if version in self.pins or version in self.permanent:
                continue
            self._drop(version)
            self.stats.evictions += 1
        return self.bytes_used + size <= self.budget_bytes

    def _load(self, version: str) -> None:
        start = time.perf_counter()
        try:
            adapter = self.fetch(version)
            if self.pin_memory:
                adapter = _pinned(adapter)
            self._done.put((version, adapter, None, time.perf_counter() - start))
        except Exception as exc:  # noqa: BLE001 - any failure is reported to the waiting requests
            self._done.put((version, None, f"{type(exc).__name__}: {exc}", 0.0))
        self._wake.set()


def _pinned(adapter: LoraAdapter) -> LoraAdapter:
    """Page-locked copies, so host->device copies can run asynchronously."""
    weights = {k: LoraWeights(w.a.pin_memory(), w.b.pin_memory(), w.scaling) for k, w in adapter.weights.items()}
    return dataclasses.replace(adapter, weights=weights)
