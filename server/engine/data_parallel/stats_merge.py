"""One EngineSnapshot from N engine cores' (/metrics, /admin/engine and the console read the sum).

Counters and gauges add up (requests, KV blocks, tier bytes and budgets, hits, loads); adapter sets are
their union; a flag is on where any core has it on; a per-position tuple adds position by position; a
name (the speculative method) is the first core's; an absent budget (None: unbounded) stays absent.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from server.engine.protocol.snapshot import EngineSnapshot


def merge_snapshots(snapshots: Sequence[EngineSnapshot]) -> EngineSnapshot:
    first = snapshots[0]
    dora = {key: sum(s.dora_scales.get(key, 0) for s in snapshots) for key in first.dora_scales}
    base = next((s.dora_base for s in snapshots if s.dora_base is not None), None)
    return EngineSnapshot(_merge([s.stats for s in snapshots]), dora, base)


def _merge(values: list):
    first = values[0]
    if dataclasses.is_dataclass(first):
        return dataclasses.replace(first, **{f.name: _merge([getattr(v, f.name) for v in values])
                                             for f in dataclasses.fields(first)})
    if isinstance(first, bool):
        return any(values)
    if isinstance(first, (int, float)):
        return sum(values) if all(v is not None for v in values) else None
    if isinstance(first, frozenset):
        return frozenset().union(*values)
    if isinstance(first, tuple):
        width = max(len(v) for v in values)
        return tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
    return first  # a name, or None (an unbounded budget: unbounded on every core alike)
