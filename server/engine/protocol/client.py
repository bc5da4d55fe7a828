"""EngineClient: everything the front end (the HTTP side) may ask of the engine.

The front end holds one of these and nothing else of the engine: no LLMEngine, scheduler, model or
tier objects (tests/server/api/test_engine_boundary.py checks its imports). Its arguments and answers
are the protocol's messages (EngineRequest, RequestOutput, EngineInfo, EngineSnapshot: frozen
dataclasses of primitives and compact lists), so the engine-core process's client (msgspec over ZMQ,
server.engine.protocol.remote: `serve`'s default) stands where the in-process one
(server.engine.async_engine) does.
"""
from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from server.engine.llm_engine import EngineStats
from server.engine.protocol.cores import EngineCoreReport
from server.engine.protocol.info import EngineInfo
from server.engine.protocol.outputs import OutputStream
from server.engine.protocol.request import EngineRequest
from server.engine.protocol.residency import AdapterTiers, LoadTimes
from server.engine.protocol.snapshot import EngineSnapshot

if TYPE_CHECKING:
    from adapters.format import LoraAdapter
    from server.engine.grammar_worker import GrammarCompileService


class EngineClient(ABC):
    info: EngineInfo  # fixed at start

    # ---- lifecycle and health ----
    @abstractmethod
    def start(self) -> None:
        """Start the step loop; requests are served from then on."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the step loop (every open stream ends with EngineDeadError) and free the engine."""

    @property
    @abstractmethod
    def is_healthy(self) -> bool:
        """The step loop runs."""

    @property
    @abstractmethod
    def error(self) -> str | None:
        """Why the step loop died, for /health; None while it runs or after a clean shutdown."""

    @property
    def is_restarting(self) -> bool:
        """The engine died and a new one is starting (--engine-restart): not healthy, not gone for good."""
        return False

    # ---- requests ----
    @abstractmethod
    async def submit(self, request: EngineRequest) -> OutputStream:
        """Add the request; raises RequestError (too long, unknown adapter...) before any output,
        EngineDeadError when the engine is not running."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Thread-safe; a no-op for a request that already finished."""

    # ---- adapters (keyed by immutable version id) ----
    @abstractmethod
    async def add_adapter(self, version_id: str, adapter: LoraAdapter) -> None:
        """Preload a parsed adapter version into the host tier."""

    @abstractmethod
    async def remove_adapter(self, version_id: str) -> None:
        """The version leaves every tier once no request uses it, and its cached KV blocks at once."""

    @abstractmethod
    def remove_adapter_nowait(self, version_id: str) -> None:
        """remove_adapter without waiting; ordered with every other command. Callable from any thread."""

    @abstractmethod
    async def release_adapter_memory(self, version_id: str) -> None:
        """vLLM's unload: the version leaves the device slots and the host tier once no request uses it,
        and stays valid (its next request loads it again; its cached KV still holds)."""

    @abstractmethod
    async def pin_adapter(self, version_id: str, tenant: str | None) -> bool:
        """Keep the version on the device once loaded, never evicted; False (nothing pinned) when `tenant`
        already pins max_pinned_adapters_per_tenant versions."""

    @abstractmethod
    async def unpin_adapter(self, version_id: str) -> bool:
        """The version may be evicted again; whether it was pinned."""

    @abstractmethod
    async def has_adapter(self, version_id: str) -> bool:
        """The version is loaded in the host tier."""

    @abstractmethod
    async def adapter_residency(self) -> dict[str, str]:
        """version -> the fastest tier holding it ("device" or "host"); versions in neither are absent."""

    @abstractmethod
    async def adapter_tiers(self) -> AdapterTiers:
        """Which versions each tier holds (device slots, host memory), between two steps."""

    @abstractmethod
    def held_adapter_versions(self, timeout: float) -> set[str]:
        """Every version the engine holds in any tier, loading and parked ones included. Blocking: for
        threads off the event loop (the registry's retirement listener)."""

    @abstractmethod
    def precompute_dora(self, version_id: str, adapter: LoraAdapter) -> concurrent.futures.Future[str]:
        """Compute and store a DoRA version's scales against the served base unless the store has them;
        a plain LoRA adapter is done at once. The future's result names the outcome
        (server.engine.lora.dora_precompute)."""

    @abstractmethod
    def nap(self, seconds: float) -> concurrent.futures.Future[None]:
        """Hold the step loop between two steps for `seconds` (at most 60; commands wait too), so that a
        running request is still running when a test or bench acts on it; done when the nap is over.
        Naps sent back to back run back to back: the loop steps once a nap ends with none queued."""

    # ---- structured output ----
    @abstractmethod
    def grammar_compiler(self, timeout_ms: int, cpus: tuple[int, ...] | None = None) -> GrammarCompileService:
        """The front end's compiler of constraints for this engine's vocabulary (EngineRequest.grammar);
        `cpus`: the cores its compile processes run on (server.cpu_placement; None: not pinned)."""

    # ---- stats ----
    @abstractmethod
    def stats(self) -> EngineStats:
        """The counters as of the last step or command (a consistent snapshot; never waits)."""

    @abstractmethod
    def snapshot(self) -> EngineSnapshot:
        """stats() and the engine's other published counters."""

    def engine_cores(self) -> list[EngineCoreReport]:
        """Each engine core's own report where there are several (data parallel); [] for one engine."""
        return []

    @abstractmethod
    def take_load_times(self) -> LoadTimes:
        """Adapter load durations per tier (Redis -> host, host -> device slot) since the last call: for one
        reader, /metrics."""
