"""DataParallelEngineClient: the EngineClient over N engine-core processes (--data-parallel-size).

Requests: the router picks a core per request (server.engine.data_parallel.router) from what this
client knows of each: its health, its load, the adapter versions in its device slots (read from the
core every REFRESH_S, plus the running ones of its last stats and those routed there since) and those
waiting there. The load is what the core itself last published (its running and waiting requests,
whichever front end sent them: with --api-server-count several front ends route over the same cores)
plus this client's requests accepted there since that push, and never less than this client's own
requests still running there (exact: counted as streams end).

Adapters: load, unload, release, pin and unpin go to every core (each has its own tiers; a version's
registry entry is shared through Redis), answers combined (pinned where every core pinned it, resident
at its fastest tier on any core). Stats: the cores' snapshots merged (stats_merge), and each core's own
for the per-engine labels of /metrics.

Health: each core restarts on its own under --engine-restart (its RemoteEngineClient's policy); while one
restarts the others keep serving, and the server is healthy while any core is ready. A core that is gone
for good (no restart, or its crash-loop limit reached) ends the server, as one core's would.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from server.engine.data_parallel.counted_stream import CountedStream
from server.engine.data_parallel.router import CoreView, Router
from server.engine.data_parallel.stats_merge import merge_snapshots
from server.engine.engine_stats import EngineStats
from server.engine.grammar_worker import GrammarCompileService
from server.engine.protocol.client import EngineClient
from server.engine.protocol.cores import EngineCoreReport
from server.engine.protocol.errors import EngineDeadError
from server.engine.protocol.info import EngineInfo
from server.engine.protocol.request import EngineRequest
from server.engine.protocol.residency import AdapterTiers, LoadTimes
from server.engine.protocol.snapshot import EngineSnapshot

if TYPE_CHECKING:
    from adapters.format import LoraAdapter
    from server.engine.protocol.remote import RemoteEngineClient

log = logging.getLogger(__name__)

REFRESH_S = 0.5  # how often each core's device slots are read for the router
REFRESH_TIMEOUT_S = 2.0
PLACED_S = 2.0  # a version routed to a core counts as on its device this long (its load may be under way)
TIERS = ("host", "device")  # adapter_residency's names, slowest first


class DataParallelEngineClient(EngineClient):
    def __init__(self, cores: list[RemoteEngineClient], routing: str) -> None:
        self.cores = cores
        self.info = _summed_info([core.info for core in cores])
        self.router = Router(routing)
        self._in_flight = [0] * len(cores)
        self._accepted: list[dict[str, float]] = [{} for _ in cores]  # request id -> when the core accepted it
        self._device: list[frozenset[str]] = [frozenset()] * len(cores)
        self._placed: list[dict[str, float]] = [{} for _ in cores]  # version -> when routed there
        self.routed = [0] * len(cores)  # requests sent to each core since start
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="dp-residency", daemon=True)
        self._refresher.start()

    @classmethod
    def build(cls, start_cores: list, routing: str) -> "DataParallelEngineClient":
        """Blocking: starts every core at once (each `start_cores` item builds one RemoteEngineClient)
        and waits until all are ready; one that cannot start stops the others."""
        with concurrent.futures.ThreadPoolExecutor(len(start_cores), thread_name_prefix="dp-start") as pool:
            futures = [pool.submit(start) for start in start_cores]
            concurrent.futures.wait(futures)
        started = [f.result() for f in futures if f.exception() is None]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for core in started:
                core.shutdown()
            raise failed[0]
        return cls(started, routing)

    # ---- lifecycle and health ----
    def start(self) -> None:
        """Each core's loop runs from its Ready on: nothing to start."""

    def shutdown(self) -> None:
        self._stop.set()
        with concurrent.futures.ThreadPoolExecutor(len(self.cores), thread_name_prefix="dp-stop") as pool:
            list(pool.map(lambda core: core.shutdown(), self.cores))

    @property
    def gave_up(self) -> bool:
        return any(core.gave_up for core in self.cores)

    @property
    def is_healthy(self) -> bool:
        return not self.gave_up and any(core.is_healthy for core in self.cores)

    @property
    def error(self) -> str | None:
        errors = [f"engine core {i}: {core.error}" for i, core in enumerate(self.cores) if core.error is not None]
        return "; ".join(errors) or None

    @property
    def is_restarting(self) -> bool:
        return not self.gave_up and not self.is_healthy and any(core.is_restarting for core in self.cores)

    @property
    def restarts(self) -> int:
        return sum(core.restarts for core in self.cores)

    @property
    def refused_messages(self) -> int:
        return sum(core.refused_messages for core in self.cores)

    # ---- requests ----
    async def submit(self, request: EngineRequest) -> CountedStream:
        index = self.router.choose(request.version_id, self.views())
        if request.version_id is not None:
            self._placed[index][request.version_id] = time.monotonic()
        self._in_flight[index] += 1
        try:
            stream = await self.cores[index].submit(request)
        except BaseException:
            self._in_flight[index] -= 1
            raise
        self.routed[index] += 1
        self._accepted[index][request.request_id] = time.monotonic()
        return CountedStream(stream, request.params.n, lambda: self._ended(index, request.request_id))

    def _ended(self, index: int, request_id: str) -> None:
        self._in_flight[index] -= 1
        self._accepted[index].pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """A no-op on the cores that do not have it (a stream's own abort goes to its core only)."""
        for core in self.cores:
            core.abort(request_id)

    def views(self) -> list[CoreView]:
        """What the router sees of each core now."""
        now = time.monotonic()
        views = []
        for i, core in enumerate(self.cores):
            placed = self._placed[i]
            for version in [v for v, at in placed.items() if now - at > PLACED_S]:
                placed.pop(version, None)
            scheduler = core.stats().scheduler if core.is_healthy else None
            running = scheduler.running_adapters if scheduler is not None else frozenset()
            load = self._in_flight[i]
            if scheduler is not None:
                unpublished = sum(at >= core.snapshot_at for at in self._accepted[i].values())
                load = max(load, scheduler.running + scheduler.waiting + unpublished)
            views.append(CoreView(
                healthy=core.is_healthy, in_flight=load, max_num_seqs=core.info.max_num_seqs,
                max_loras=core.info.max_loras, device=self._device[i] | running | placed.keys(),
                waiting=scheduler.waiting_adapters if scheduler is not None else frozenset()))
        return views

    def _refresh_loop(self) -> None:
        while not self._stop.wait(REFRESH_S):
            for i, core in enumerate(self.cores):
                if not core.is_healthy:
                    self._device[i] = frozenset()
                    continue
                try:
                    tiers = AdapterTiers.of(core.adapter_tiers_future().result(REFRESH_TIMEOUT_S))
                except (EngineDeadError, concurrent.futures.TimeoutError, RuntimeError):
                    continue  # dying or busy: the next round reads it again
                self._device[i] = frozenset(tiers.device)

    # ---- adapters: every core ----
    async def _each(self, method: str, *args) -> list:
        return await asyncio.gather(*(getattr(core, method)(*args) for core in self.cores))

    async def add_adapter(self, version_id: str, adapter: LoraAdapter) -> None:
        await self._each("add_adapter", version_id, adapter)

    async def remove_adapter(self, version_id: str) -> None:
        await self._each("remove_adapter", version_id)

    def remove_adapter_nowait(self, version_id: str) -> None:
        for core in self.cores:
            core.remove_adapter_nowait(version_id)

    async def release_adapter_memory(self, version_id: str) -> None:
        await self._each("release_adapter_memory", version_id)

    async def pin_adapter(self, version_id: str, tenant: str | None) -> bool:
        """Pinned on every core, or on none: a core that refuses (the tenant's pin limit) unpins the rest."""
        pinned = await self._each("pin_adapter", version_id, tenant)
        if all(pinned):
            return True
        await asyncio.gather(*(core.unpin_adapter(version_id) for core, ok in zip(self.cores, pinned) if ok))
        return False

    async def unpin_adapter(self, version_id: str) -> bool:
        return any(await self._each("unpin_adapter", version_id))

    async def has_adapter(self, version_id: str) -> bool:
        return any(await self._each("has_adapter", version_id))

    async def adapter_residency(self) -> dict[str, str]:
        best: dict[str, str] = {}
        for residency in await self._each("adapter_residency"):
            for version, tier in residency.items():
                if version not in best or TIERS.index(tier) > TIERS.index(best[version]):
                    best[version] = tier
        return best

    async def adapter_tiers(self) -> AdapterTiers:
        tiers = await self._each("adapter_tiers")
        return AdapterTiers(device=sorted(set().union(*(t.device for t in tiers))),
                            host=sorted(set().union(*(t.host for t in tiers))))

    async def core_adapter_tiers(self) -> list[AdapterTiers]:
        """Each core's tiers, in core order (/metrics' per-engine residency)."""
        return await self._each("adapter_tiers")

    def held_adapter_versions(self, timeout: float) -> set[str]:
        return set().union(*(core.held_adapter_versions(timeout) for core in self.cores))

    def precompute_dora(self, version_id: str, adapter: LoraAdapter) -> concurrent.futures.Future[str]:
        """On one core: the scales go to the shared store, where the others read them."""
        return self._ready_core().precompute_dora(version_id, adapter)

    def nap(self, seconds: float) -> concurrent.futures.Future[None]:
        naps = [core.nap(seconds) for core in self.cores]
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        remaining = [len(naps)]
        lock = threading.Lock()

        def one_done(_: concurrent.futures.Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                done.set_result(None)

        for nap in naps:
            nap.add_done_callback(one_done)
        return done

    def _ready_core(self) -> RemoteEngineClient:
        return next((core for core in self.cores if core.is_healthy), self.cores[0])

    # ---- structured output: compiled in the front end, for the one vocabulary every core serves ----
    def grammar_compiler(self, timeout_ms: int, cpus: tuple[int, ...] | None = None) -> GrammarCompileService:
        return self.cores[0].grammar_compiler(timeout_ms, cpus)

    # ---- stats ----
    def stats(self) -> EngineStats:
        return self.snapshot().stats

    def snapshot(self) -> EngineSnapshot:
        return merge_snapshots(self.core_snapshots())

    def core_snapshots(self) -> list[EngineSnapshot]:
        """Each core's last snapshot, in core order."""
        return [core.snapshot() for core in self.cores]

    def engine_cores(self) -> list[EngineCoreReport]:
        return [EngineCoreReport(i, core.is_healthy, core.error, core.restarts, self.routed[i], core.info.max_loras,
                                 core.snapshot()) for i, core in enumerate(self.cores)]

    def take_load_times(self) -> LoadTimes:
        taken = [core.take_load_times() for core in self.cores]
        return LoadTimes(host=[s for t in taken for s in t.host], device=[s for t in taken for s in t.device])


def _summed_info(infos: list[EngineInfo]) -> EngineInfo:
    """The server's capacity: the cores' slots, batch seats and KV pools (with --unified-memory the pools'
    units too) added up (what /admin/engine and vllm:max_gpu_lora_adapters show beside the summed
    counters); limits a request must fit are each core's."""
    first = infos[0]
    unified = first.kv_pool.unified  # --unified-memory: each core's pool; its units add up as the blocks do
    if unified is not None:
        unified = dataclasses.replace(unified, **{name: sum(getattr(i.kv_pool.unified, name) for i in infos)
                                                  for name in ("units", "kv_share", "adapter_share")})
    pool = dataclasses.replace(first.kv_pool, blocks=sum(i.kv_pool.blocks for i in infos),
                               bytes=sum(i.kv_pool.bytes for i in infos), unified=unified)
    return dataclasses.replace(first, max_loras=sum(i.max_loras for i in infos),
                               max_num_seqs=sum(i.max_num_seqs for i in infos), kv_pool=pool)
