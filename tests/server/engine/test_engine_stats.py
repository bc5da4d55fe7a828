"""EngineStats (server.engine.engine_stats): the subsystems' snapshots nested, and the flat names it
had before still reading the same values, with a DeprecationWarning."""
from __future__ import annotations

import dataclasses

import pytest

from adapters.host_tier import HostTierSnapshot
from server.engine.async_step import AsyncStats
from server.engine.block_manager import KvBlockStats, PrefixCacheStats
from server.engine.decode_graphs import DecodeGraphStats
from server.engine.engine_stats import FLAT_NAMES, EngineStats
from server.engine.grammar import GrammarStats
from server.engine.lora.slots import SlotStats
from server.engine.scheduler import SchedulerStats

pytestmark = pytest.mark.unit


def numbered(cls):
    """An instance of the snapshot dataclass `cls` whose every field holds a distinct value."""
    values = {f.name: f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls)}
    return cls(**values)


def test_flat_names_read_their_section_with_a_warning():
    stats = EngineStats(numbered(SchedulerStats), numbered(KvBlockStats), numbered(PrefixCacheStats),
                        numbered(HostTierSnapshot), numbered(SlotStats), numbered(DecodeGraphStats),
                        numbered(AsyncStats), numbered(GrammarStats), constrained_requests=7)
    for name, (section, field) in FLAT_NAMES.items():
        with pytest.warns(DeprecationWarning, match=f"EngineStats.{section}.{field}"):
            assert getattr(stats, name) == getattr(getattr(stats, section), field)
    assert len({getattr(getattr(stats, s), f) for s, f in FLAT_NAMES.values()}) == len(FLAT_NAMES)
    assert stats.constrained_requests == 7
    with pytest.raises(AttributeError):
        stats.no_such_field  # noqa: B018


def test_every_old_field_has_a_flat_name():
    """The 40 fields EngineStats had when it was flat: each reads through FLAT_NAMES, or is a field still."""
    old = ("num_running num_waiting kv_blocks_used kv_blocks_total adapters_registered adapters_resident adapter_loads "
           "num_preemptions host_bytes_used host_budget_bytes host_hits host_misses host_loads host_load_failures "
           "host_evictions adapters_loading adapters_parked host_parked_bytes device_hits device_evictions "
           "prefix_cache_enabled prefix_queries_tokens prefix_hit_tokens prefix_cached_blocks "
           "prefix_cached_free_blocks cuda_graphs graph_replays graph_capture_seconds graph_capture_bytes async_steps "
           "async_steps_ahead async_rows_discarded constrained_requests grammar_compiles grammar_cache_hits "
           "grammar_compile_seconds grammar_failures grammars_cached running_adapters waiting_adapters").split()
    fields = {f.name for f in dataclasses.fields(EngineStats)}
    assert len(old) == 40 and all(name in FLAT_NAMES or name in fields for name in old)
