"""EngineSnapshot: the engine's counters as of its last step, for /metrics, /admin/engine and the console."""
from __future__ import annotations

from dataclasses import dataclass

from server.engine.llm_engine import EngineStats

__all__ = ["EngineSnapshot", "EngineStats"]


@dataclass(frozen=True)
class EngineSnapshot:
    """Published by the engine after every step or command (never older than one step), read without
    waiting for it. `stats` is the engine's EngineStats as they are (flat or nested); `dora_scales`
    the DoRA scale cache's counters (server.engine.lora.dora_scale_cache.DoraScaleStats)."""

    stats: EngineStats
    dora_scales: dict[str, int]
