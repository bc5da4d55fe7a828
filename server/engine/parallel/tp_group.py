"""The process group a tensor-parallel model's ranks share, and joining it."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

# A collective that waits longer than this for a rank fails instead of hanging: a worker that died
# mid-step takes the engine down cleanly (gloo raises on every surviving rank).
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TpGroup:
    """This process's place in a tensor-parallel group: rank of world_size, and the group to reduce over."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None  # None: the default (world) group

    def span(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [lo, hi) of n items split evenly (heads, intermediate columns): refused where uneven."""
        if n % self.world_size:
            raise ValueError(f"tensor parallel size {self.world_size} does not divide {what} ({n})")
        size = n // self.world_size
        return self.rank * size, (self.rank + 1) * size


def join_gloo(rank: int, world_size: int, init_method: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> TpGroup:
    """Joins (or makes) the default process group over gloo: init_method is a tcp://host:port or
    file:// rendezvous every rank is given."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return TpGroup(rank, world_size)
