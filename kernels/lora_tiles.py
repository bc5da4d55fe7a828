"""Tile sizes of the LoRA kernels, per element size, so every allowed configuration fits one SM.

Shared memory per program is about num_stages (3) x the operand tiles of one
loop iteration; the limits are 227 KB per block on sm_90 and 163 KB on sm_80.
Rank is tiled (shrink: across programs; expand: a loop) at most `rank_cap`
wide, so max_lora_rank 512 costs more programs or iterations, never a larger
tile: before, fp32 at rank 512 needed 262-328 KB and did not launch. fp32
tiles are half the 16-bit ones: same bytes, and fp32 products run on FMA units
(no tensor cores), whose accumulators live in registers.
benchmarks/aot/aot_check.py compiles every variant and fails if one stops fitting.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraTiles:
    shrink_k: int  # segmented shrink: input features per loop iteration (BLOCK_K)
    expand_n: int  # segmented expand: output columns per program (BLOCK_N)
    rank_cap: int  # widest rank tile (BLOCK_R), any kernel
    gather_elems: int  # gathered kernels: elements of the weight tile held in registers

    def __post_init__(self) -> None:
        for name in ("shrink_k", "expand_n", "rank_cap", "gather_elems"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.gather_elems < 16 * self.rank_cap:
            raise ValueError("gather_elems must hold at least 16 columns of the widest rank tile")

    def rank_block(self, rank: int) -> int:
        """BLOCK_R for an effective rank: 16 (tl.dot's minimum) up to rank 16, the widest tile above.

        Two classes, not one per power of two: each class is a compiled variant per kernel, and a
        masked rank column costs compute but no memory traffic, which these kernels are bound by.
        """
        return 16 if rank <= 16 else self.rank_cap

    def gather_block(self, rank_block: int, width: int) -> int:
        """The other side of a gathered [rank_block, n] tile: as wide as the register budget allows."""
        return max(16, min(_next_power_of_2(width), self.gather_elems // rank_block))



def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for n >= 1, without importing triton: this module is on the CPU
    engine's import path (server.engine.warmup), where triton is neither used nor installed."""
    return 1 << (n - 1).bit_length()


WIDE = LoraTiles(shrink_k=64, expand_n=128, rank_cap=64, gather_elems=4096)  # fp16 / bf16
FP32 = LoraTiles(shrink_k=32, expand_n=64, rank_cap=32, gather_elems=2048)


def lora_tiles(dtype: torch.dtype) -> LoraTiles:
    return FP32 if dtype == torch.float32 else WIDE
