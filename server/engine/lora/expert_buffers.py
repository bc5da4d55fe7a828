"""An MoE layer's expert LoRA slots: every expert's A and B^T for every slot, at the maximum rank.

An adapter's expert modules arrive one per (expert, fused weight) from adapters.format, named
`experts.{e}.gate_up_proj` / `experts.{e}.down_proj` (adapters.expert_params: PEFT's target_parameters
on transformers 5's fused expert weights, split per expert); they fill expert e's rows of the slot here,
as a dense module fills its slice of a LoraGroupBuffers.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from adapters.expert_params import expert_of

# A fused expert weight -> the layer's slot group it fills.
EXPERT_GROUPS = {"gate_up_proj": "experts_gate_up", "down_proj": "experts_down"}


def expert_target(proj: str) -> tuple[str, int] | None:
    """(slot group, expert) of an adapter's expert projection (adapters.expert_params); None for a dense one."""
    found = expert_of(proj)
    return None if found is None else (EXPERT_GROUPS[found[1]], found[0])


@dataclass
class ExpertLoraBuffers:
    """One fused expert weight's slots (kernels.expert_lora_ref's operands)."""

    a: torch.Tensor  # [E, L, R, in]
    b: torch.Tensor  # [E, L, R, out]: B^T, rank-major
    scaling: torch.Tensor  # [E, L] float32
    dora_scale = None  # DoRA is refused on experts (PEFT's ParamWrapper refuses it too)

    @classmethod
    def allocate(cls, num_experts: int, in_features: int, out_features: int, max_loras: int, max_rank: int,
                 dtype, device, zeros: Callable = torch.zeros) -> "ExpertLoraBuffers":
        """A and B^T made by `zeros(shape, dtype=, device=)` (a stand-in until the draft's slots are needed:
        server.engine.lora.draft_slots)."""
        return cls(a=zeros((num_experts, max_loras, max_rank, in_features), dtype=dtype, device=device),
                   b=zeros((num_experts, max_loras, max_rank, out_features), dtype=dtype, device=device),
                   scaling=torch.zeros(num_experts, max_loras, dtype=torch.float32, device=device))

    def repage(self, pages: int, zeros: Callable) -> None:
        """A and B^T made by `zeros` in place of the ones allocated (experts keep slots: `pages` is the
        slot count, as allocated)."""
        assert pages == self.a.shape[1]
        self.a = zeros(tuple(self.a.shape), dtype=self.a.dtype, device=self.a.device)
        self.b = zeros(tuple(self.b.shape), dtype=self.b.dtype, device=self.b.device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.a, self.b, self.scaling

    @property
    def num_modules(self) -> int:
        return self.a.shape[0]

    @property
    def slot_numel(self) -> int:
        """Elements one slot holds (A and B^T of every expert)."""
        return self.a[:, 0].numel() + self.b[:, 0].numel()

    def views(self, slot: int, expert: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The slot's A [r, in] and B^T [r, out] rows of `expert`, and its scaling entry."""
        return self.a[expert, slot, :rank], self.b[expert, slot, :rank], self.scaling[expert, slot]
