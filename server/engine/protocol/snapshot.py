"""EngineSnapshot: the engine's counters as of its last step, for /metrics, /admin/engine and the console."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from server.engine.llm_engine import EngineStats

if TYPE_CHECKING:
    from server.engine.llm_engine import LLMEngine

__all__ = ["EngineSnapshot", "EngineStats", "engine_snapshot"]


@dataclass(frozen=True)
class EngineSnapshot:
    """Published by the engine after every step or command (never older than one step), read without
    waiting for it. `stats` is the engine's EngineStats as they are (flat or nested); `dora_scales`
    the DoRA scale cache's counters (server.engine.lora.dora_scale_cache.DoraScaleStats); `dora_base`
    the served weights' identity that DoRA scales are stored under, once computed (at the first DoRA
    adapter), else None."""

    stats: EngineStats
    dora_scales: dict[str, int]
    dora_base: str | None = None


def engine_snapshot(engine: LLMEngine, stats: EngineStats) -> EngineSnapshot:
    """On the engine's loop thread."""
    cache = engine.lora_slots.dora_cache
    return EngineSnapshot(stats, dict(vars(cache.stats)), cache.known_base)
