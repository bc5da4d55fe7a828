"""Which engine core a request goes to: the lora-affinity tiers of the inference gateway's router, or
round-robin (--data-parallel-routing, for comparison).

Affinity, among the healthy cores with room in their batch (in-flight below max_num_seqs; all healthy
cores when none has room): the cores whose device slots hold the request's adapter, else those with a
free slot, else those where the adapter is waiting already, else all; the least loaded of the first
tier that is not empty, the lowest index on a tie. A base-model request goes to the least loaded.

Room comes first so that affinity never queues a tenant behind a full batch while another core has
seats: a tenant whose adapters all sit on one core spills onto the others once that core is full, and
one that spreads its adapters over every core cannot starve a tenant kept on one (each core's fair
scheduler shares its batch among the tenants there, and a full core sends the next request elsewhere).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from server.engine.protocol.errors import EngineDeadError

ROUTINGS = ("affinity", "round-robin")


@dataclass(frozen=True)
class CoreView:
    """What the router knows of one engine core when it routes."""

    healthy: bool
    in_flight: int  # its requests running or waiting, from every front end (client.views: the load)
    max_num_seqs: int
    max_loras: int  # device slots
    device: frozenset[str]  # adapter versions in its device slots (or on their way there)
    waiting: frozenset[str]  # adapter versions of its waiting requests


class Router:
    def __init__(self, routing: str) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        self.routing = routing
        self._turns = itertools.count()

    def choose(self, version_id: str | None, cores: Sequence[CoreView]) -> int:
        """The index of the core to send the request to; EngineDeadError when none is healthy."""
        healthy = [i for i, core in enumerate(cores) if core.healthy]
        if not healthy:
            raise EngineDeadError("the engine is not running (no engine core is ready)")
        if self.routing == "round-robin":
            return healthy[next(self._turns) % len(healthy)]
        pool = [i for i in healthy if cores[i].in_flight < cores[i].max_num_seqs] or healthy
        if version_id is not None:
            for tier in (lambda c: version_id in c.device, lambda c: len(c.device) < c.max_loras,
                         lambda c: version_id in c.waiting):
                if matching := [i for i in pool if tier(cores[i])]:
                    pool = matching
                    break
        return min(pool, key=lambda i: (cores[i].in_flight, i))
