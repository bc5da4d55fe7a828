"""InProcessEngineClient: the EngineClient over an AsyncEngine in this process (the step loop on its
own thread). The server's only mode today; later the LLM API's and tests' mode beside an engine-core
process."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from server.engine.adapter_residency import adapter_tiers, held_versions, residency, take_load_times
from server.engine.async_engine import AsyncEngine, RequestStream
from server.engine.config import EngineConfig
from server.engine.core.commands import nap
from server.engine.grammar_worker import GrammarCompileService
from server.engine.llm_engine import EngineStats, LLMEngine
from server.engine.protocol.client import EngineClient
from server.engine.protocol.info import engine_info
from server.engine.protocol.request import EngineRequest
from server.engine.protocol.residency import AdapterTiers, LoadTimes
from server.engine.protocol.snapshot import EngineSnapshot, engine_snapshot

if TYPE_CHECKING:
    from adapters.format import LoraAdapter
    from adapters.host_tier import Fetch
    from server.engine.lora.dora_scale_cache import ScaleStore


class InProcessEngineClient(EngineClient):
    """`engine` (the LLMEngine itself), call() and post() are this mode's own: for tests and the
    in-process LLM API. The HTTP side never reads them (tests/server/api/test_engine_boundary.py)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # read-only attributes (tokenizer, ...) are safe to share; the rest is the loop's
        self._loop = AsyncEngine(engine)
        self.info = engine_info(engine)

    @classmethod
    def build(cls, config: EngineConfig, adapter_source: Fetch | None = None,
              dora_scale_store: ScaleStore | None = None) -> "InProcessEngineClient":
        """Blocking: loads the weights and sizes the pools."""
        return cls(LLMEngine(config, adapter_source, dora_scale_store))

    # ---- lifecycle and health ----
    def start(self) -> None:
        self._loop.start()

    def shutdown(self) -> None:
        self._loop.shutdown()
        self.engine.shutdown()

    @property
    def is_healthy(self) -> bool:
        return self._loop.is_healthy

    @property
    def error(self) -> str | None:
        return self._loop.error

    # ---- requests ----
    async def submit(self, request: EngineRequest) -> RequestStream:
        return await self._loop.submit(request)

    def abort(self, request_id: str) -> None:
        self._loop.abort(request_id)

    # ---- adapters ----
    async def add_adapter(self, version_id: str, adapter: LoraAdapter) -> None:
        await self._loop.add_adapter(version_id, adapter)

    async def remove_adapter(self, version_id: str) -> None:
        await self._loop.remove_adapter(version_id)

    def remove_adapter_nowait(self, version_id: str) -> None:
        self._loop.remove_adapter_nowait(version_id)

    async def release_adapter_memory(self, version_id: str) -> None:
        await self._loop.call(lambda engine: engine.release_adapter_memory(version_id))

    async def pin_adapter(self, version_id: str, tenant: str | None) -> bool:
        return await self._loop.call(lambda engine: engine.pin_adapter(version_id, tenant))

    async def unpin_adapter(self, version_id: str) -> bool:
        return await self._loop.call(lambda engine: engine.unpin_adapter(version_id))

    async def has_adapter(self, version_id: str) -> bool:
        return await self._loop.has_adapter(version_id)

    async def adapter_residency(self) -> dict[str, str]:
        return await self._loop.call(residency)

    async def adapter_tiers(self) -> AdapterTiers:
        return await self._loop.call(adapter_tiers)

    def held_adapter_versions(self, timeout: float) -> set[str]:
        return self._loop.call_soon(held_versions).result(timeout=timeout)

    def precompute_dora(self, version_id: str, adapter: LoraAdapter) -> concurrent.futures.Future[str]:
        return self.engine.dora_precompute.submit(version_id, adapter)  # its own thread, not the loop's

    def nap(self, seconds: float) -> concurrent.futures.Future[None]:
        return self._loop.call_soon(lambda e: nap(seconds))

    # ---- structured output ----
    def grammar_compiler(self, timeout_ms: int, cpus: tuple[int, ...] | None = None) -> GrammarCompileService:
        return GrammarCompileService(self.engine.grammars, timeout_ms, cpus=cpus)

    # ---- stats ----
    def stats(self) -> EngineStats:
        return self._loop.stats()

    def snapshot(self) -> EngineSnapshot:
        return engine_snapshot(self.engine, self._loop.stats())

    def take_load_times(self) -> LoadTimes:
        return take_load_times(self.engine)

    # ---- in-process only ----
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn on the loop thread and wait for its result."""
        return await self._loop.call(fn)

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run fn on the loop thread without waiting; ordered with every other command."""
        self._loop.post(fn)

