"""What the tensor-parallel leader (rank 0, in the engine) sends its workers: a step, or stop."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import AttentionBatch, LoraBatch


@dataclass(frozen=True)
class TpStep:
    """One forward, as rank 0's runner prepared it: every rank runs it on its shard, in step order."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionBatch
    lora: LoraBatch
    logits_indices: torch.Tensor  # [N]
    block_copies: tuple[tuple[int, int], ...]  # copy-on-write (source, copy) blocks, before the forward
    # Per KV layer group its tables' batch (StepContext.group_attn: attn first), () with one group.
    group_attn: tuple[AttentionBatch, ...] = ()


@dataclass(frozen=True)
class TpStop:
    """The engine is shutting down: the worker leaves its loop and the group."""
