"""Each data-parallel core's cores and threads; the cores' stats summed into one snapshot."""
from __future__ import annotations

import dataclasses
import typing

import pytest

from server.engine.config import EngineConfig
from server.engine.engine_stats import EngineStats
from server.engine.data_parallel.core_split import DataParallelSplitError, core_configs, split_cores
from server.engine.data_parallel.stats_merge import merge_snapshots
from server.engine.protocol.snapshot import EngineSnapshot

pytestmark = pytest.mark.unit


def _zeros(cls):
    """An instance of a stats dataclass, every number 0, every set empty, every flag on, budgets None."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        values[f.name] = (_zeros(kind) if dataclasses.is_dataclass(kind) else True if kind is bool
                          else frozenset() if typing.get_origin(kind) is frozenset
                          else () if typing.get_origin(kind) is tuple else 0 if kind in (int, float) else None)
    return cls(**values)


def example_stats(running: int, adapters: set[str], accepted: tuple[int, ...]) -> EngineStats:
    stats = _zeros(EngineStats)
    return dataclasses.replace(
        stats, scheduler=dataclasses.replace(stats.scheduler, running=running, running_adapters=frozenset(adapters)),
        kv_blocks=dataclasses.replace(stats.kv_blocks, total=10),
        speculative=dataclasses.replace(stats.speculative, accepted_per_position=accepted))


def test_engine_cores_are_cut_into_contiguous_groups():
    assert split_cores((0, 1), 2) == [(0,), (1,)]
    assert split_cores((0, 1, 2, 3, 4), 2) == [(0, 1, 2), (3, 4)]
    with pytest.raises(DataParallelSplitError, match="--data-parallel-size 3 needs at least 3"):
        split_cores((0, 1), 3)


def test_each_core_is_pinned_to_its_group_with_a_thread_per_core():
    configs = core_configs(EngineConfig.of(model="m", device="cpu", cpu_affinity=(0, 1, 2, 3)), 2)
    assert [c.device.cpu_affinity for c in configs] == [(0, 1), (2, 3)]
    assert [c.device.resolve_cpu_threads() for c in configs] == [2, 2]
    configs = core_configs(EngineConfig.of(model="m", device="cpu", cpu_threads=3), 2)
    assert [c.device.cpu_threads for c in configs] == [3, 3]


def test_snapshots_add_up():
    one = example_stats(running=1, adapters={"a"}, accepted=(1, 2))
    two = example_stats(running=2, adapters={"b"}, accepted=(3,))
    merged = merge_snapshots([EngineSnapshot(one, {"hits": 1}, None), EngineSnapshot(two, {"hits": 2}, "base")])
    assert merged.stats.scheduler.running == 3
    assert merged.stats.scheduler.running_adapters == {"a", "b"}
    assert merged.stats.kv_blocks.total == one.kv_blocks.total * 2
    assert merged.stats.prefix_cache.enabled is True
    assert merged.stats.host.budget_bytes is None
    assert merged.stats.speculative.accepted_per_position == (4, 2)
    assert merged.dora_scales == {"hits": 3} and merged.dora_base == "base"
