"""ParallelConfig: the base split over processes (tensor parallel) and how LoRA is split with it."""
from __future__ import annotations

from dataclasses import dataclass

from server.engine.config.checks import check_at_least, check_bools


@dataclass(frozen=True)
class ParallelConfig:
    # vLLM's --tensor-parallel-size: the base split across this many processes joined by torch.distributed
    # (gloo, CPU devices; server.engine.parallel), each with its heads, intermediate columns and vocabulary
    # rows; 1: one process, as without it.
    tensor_parallel_size: int = 1
    # vLLM's --fully-sharded-loras: under tensor parallel, LoRA's A split by rank rows too (S-LoRA), a small
    # all_gather/all_reduce of the shrink output per layer (server.engine.parallel.sharded_lora).
    fully_sharded_loras: bool = False

    def __post_init__(self) -> None:
        check_at_least(self, 1, "tensor_parallel_size")
        check_bools(self, "fully_sharded_loras")
        if self.fully_sharded_loras and self.tensor_parallel_size == 1:
            raise ValueError("fully_sharded_loras needs tensor_parallel_size > 1 (one process has nothing to shard)")
