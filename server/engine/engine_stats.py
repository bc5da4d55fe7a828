"""EngineStats: one snapshot of the engine, each subsystem's own report nested in it.

The flat names it had before it nested (`stats.num_running`, `stats.host_hits`, ...) still read,
through FLAT_NAMES, with a DeprecationWarning: read the sections instead.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from adapters.host_tier import HostTierSnapshot
from server.engine.async_step import AsyncStats
from server.engine.block_manager import KvBlockStats, PrefixCacheStats
from server.engine.decode_graphs import DecodeGraphStats
from server.engine.grammar import GrammarStats
from server.engine.lora.slots import SlotStats
from server.engine.scheduler import SchedulerStats, SpecDecodeStats

# Deprecated flat name -> (section, field).
FLAT_NAMES = {
    "num_running": ("scheduler", "running"),
    "num_waiting": ("scheduler", "waiting"),
    "num_preemptions": ("scheduler", "preemptions"),
    "running_adapters": ("scheduler", "running_adapters"),
    "waiting_adapters": ("scheduler", "waiting_adapters"),
    "kv_blocks_used": ("kv_blocks", "used"),
    "kv_blocks_total": ("kv_blocks", "total"),
    "adapters_registered": ("host", "adapters"),
    "host_bytes_used": ("host", "bytes_used"),
    "host_budget_bytes": ("host", "budget_bytes"),
    "host_hits": ("host", "hits"),
    "host_misses": ("host", "misses"),
    "host_loads": ("host", "loads"),
    "host_load_failures": ("host", "load_failures"),
    "host_evictions": ("host", "evictions"),
    "adapters_loading": ("host", "loading"),
    "adapters_parked": ("host", "parked"),
    "host_parked_bytes": ("host", "parked_bytes"),
    "adapters_resident": ("slots", "resident"),
    "adapter_loads": ("slots", "loads"),
    "device_hits": ("slots", "hits"),
    "device_evictions": ("slots", "evictions"),
    "prefix_cache_enabled": ("prefix_cache", "enabled"),
    "prefix_queries_tokens": ("prefix_cache", "queried_tokens"),
    "prefix_hit_tokens": ("prefix_cache", "hit_tokens"),
    "prefix_cached_blocks": ("prefix_cache", "cached_blocks"),
    "prefix_cached_free_blocks": ("prefix_cache", "cached_free_blocks"),
    "cuda_graphs": ("decode_graphs", "graphs"),
    "graph_replays": ("decode_graphs", "replays"),
    "graph_capture_seconds": ("decode_graphs", "capture_seconds"),
    "graph_capture_bytes": ("decode_graphs", "capture_bytes"),
    "async_steps": ("async_scheduling", "launched"),
    "async_steps_ahead": ("async_scheduling", "ahead"),
    "async_rows_discarded": ("async_scheduling", "discarded"),
    "grammar_compiles": ("grammar", "compiles"),
    "grammar_cache_hits": ("grammar", "cache_hits"),
    "grammar_compile_seconds": ("grammar", "compile_seconds"),
    "grammar_failures": ("grammar", "failures"),
    "grammars_cached": ("grammar", "cached"),
}


@dataclass(frozen=True)
class StepCounts:
    """Two running counters, cheap to read around every step (stats() snapshots every subsystem): a bench splits
    its window's steps into graphed and eager with them (server.bench.step_kinds)."""

    steps: int  # steps that ran a batch on the device: plain ones and those launched under async scheduling
    graphed: int  # of those, decode steps that replayed a CUDA graph (server.engine.decode_graphs)


@dataclass(frozen=True)
class EngineStats:
    scheduler: SchedulerStats
    kv_blocks: KvBlockStats
    prefix_cache: PrefixCacheStats  # server.engine.block_manager
    host: HostTierSnapshot  # host tier: parsed adapters in host memory (adapters.host_tier)
    slots: SlotStats  # device tier: adapters in slots (server.engine.lora.slots)
    decode_graphs: DecodeGraphStats  # decode CUDA graphs (server.engine.decode_graphs)
    async_scheduling: AsyncStats  # server.engine.async_step
    grammar: GrammarStats  # the compiled-grammar cache (server.engine.grammar)
    constrained_requests: int  # requests admitted with a structured-output constraint
    speculative: SpecDecodeStats = SpecDecodeStats()  # server.engine.scheduler.SpecDecodeCounters

    def __getattr__(self, name: str):
        """The deprecated flat names (FLAT_NAMES); called only for names the class does not have."""
        try:
            section, field = FLAT_NAMES[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None
        warnings.warn(f"EngineStats.{name} is deprecated: read EngineStats.{section}.{field}", DeprecationWarning,
                      stacklevel=2)
        return getattr(getattr(self, section), field)
