"""The collectives a tensor-parallel forward makes, metered: bytes and seconds per kind, so a bench
can print the communication tensor parallelism adds per layer per step."""
from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist

from server.engine.parallel.tp_group import TpGroup


class Collectives:
    """all_reduce (the row-parallel layers' partial sums) and a gather along the last dimension (the
    vocabulary-parallel lm_head's logits) over one group; `bytes` and `seconds` count each by kind."""

    def __init__(self, tp: TpGroup) -> None:
        self.tp = tp
        self.bytes: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums t over the ranks in place (every rank gets the same float32-exact order: gloo's ring)."""
        start = time.perf_counter()
        dist.all_reduce(t, group=self.tp.group)
        self._count("all_reduce", t.nbytes, start)
        return t

    def gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Each rank's [..., n] shard side by side: [..., world_size * n], the same on every rank."""
        start = time.perf_counter()
        parts = [torch.empty_like(t) for _ in range(self.tp.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp.group)
        self._count("all_gather", t.nbytes * self.tp.world_size, start)
        return torch.cat(parts, dim=-1)

    def reset(self) -> None:
        self.bytes.clear()
        self.seconds.clear()
        self.calls.clear()

    def _count(self, kind: str, nbytes: int, start: float) -> None:
        self.bytes[kind] += nbytes
        self.seconds[kind] += time.perf_counter() - start
        self.calls[kind] += 1
