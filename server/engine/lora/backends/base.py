"""The multi-LoRA kernel strategy the model calls: the same semantics whichever one the engine picked."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kernels.expert_batch import ExpertBatch
from kernels.metadata import LoraBatch


class LoraBackend(ABC):
    """A step's adapter tokens through their slots' weights (slots: server.engine.lora.slots).

    Every strategy has kernels.lora_ref's semantics; they differ in how the work is split into
    launches or matmuls. `apply` is what the model calls; `shrink` and `expand` are its two halves,
    kept for tests and the kernel benchmarks.
    """

    name: str

    @abstractmethod
    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor, batch: LoraBatch, scaling: torch.Tensor,
               out: torch.Tensor) -> None:
        """kernels.lora_ref.lora_shrink: x [T, in]; lora_a [S, L, R, in]; scaling [S, L]; out [S, T, R]."""

    @abstractmethod
    def expand(self, h: torch.Tensor, lora_b: tuple[torch.Tensor, ...], batch: LoraBatch, y: torch.Tensor,
               slice_offsets: tuple[int, ...]) -> None:
        """kernels.lora_ref.lora_expand: h [S, T, R]; lora_b: S x [L, n_i, R]; y [T, >= max(off_i + n_i)]."""

    @abstractmethod
    def apply(self, x: torch.Tensor, lora_a: torch.Tensor, lora_b: tuple[torch.Tensor, ...], scaling: torch.Tensor,
              slice_offsets: tuple[int, ...], batch: LoraBatch, h: torch.Tensor, y: torch.Tensor) -> None:
        """One fused projection's LoRA, both sides: shrink into h (scratch [S, T, R]) then expand onto y,
        every slice; rows of slot -1 are left bit-identical."""

    @abstractmethod
    def apply_experts(self, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
                      batch: ExpertBatch, y: torch.Tensor) -> None:
        """kernels.expert_lora_ref.expert_lora_apply: an MoE layer's routed pairs x [P, in] through their
        (expert, slot) LoRA onto y [P, out]; lora_a [E, L, R, in], lora_b [E, L, R, out], scaling [E, L]."""
