"""EngineCoreReport: one engine core of several (--data-parallel-size), for /metrics' `engine` label and
/admin/engine's per-core section. A single engine reports no cores: its counters are the server's."""
from __future__ import annotations

from dataclasses import dataclass

from server.engine.protocol.snapshot import EngineSnapshot


@dataclass(frozen=True)
class EngineCoreReport:
    index: int  # the `engine` label: 0 .. N - 1
    healthy: bool
    error: str | None
    restarts: int
    routed: int  # requests sent to it since start
    max_loras: int
    snapshot: EngineSnapshot
