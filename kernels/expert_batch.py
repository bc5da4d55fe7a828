"""One MoE layer's routed (token, expert) pairs, sorted so that each expert's pairs, and within them each
adapter slot's, are contiguous: the base experts run one matmul per expert and the LoRA part one pair
of matmuls per (expert, slot) group (CPU) or one launch over every pair (kernels.expert_lora_triton).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertBatch:
    """Pairs p = 0..P-1 in (expert, slot, token) order; P = tokens x top-k."""

    tokens: torch.Tensor  # [P] int64: the token row of each pair
    experts: torch.Tensor  # [P] int32
    slots: torch.Tensor  # [P] int32: the token's adapter slot, -1 = base only
    weights: torch.Tensor  # [P]: the router's weight of the pair's expert for its token
    expert_bounds: tuple[int, ...]  # E + 1 host offsets: expert e's pairs are expert_bounds[e]:[e + 1]
    # (first pair, pairs, expert, slot) of each run with slot >= 0, on the host: the CPU path's groups.
    groups: tuple[tuple[int, int, int, int], ...]
    rank_bound: int | None = None  # highest rank among the slots present (None: the buffers' full rank)

    @property
    def num_pairs(self) -> int:
        return self.tokens.shape[0]

    def effective_rank(self, buffer_rank: int) -> int:
        return buffer_rank if self.rank_bound is None else min(buffer_rank, self.rank_bound)

    @classmethod
    def route(cls, top_experts: torch.Tensor, top_weights: torch.Tensor, token_slots: torch.Tensor | None,
              num_experts: int, num_slots: int, rank_bound: int | None = None) -> "ExpertBatch":
        """top_experts [T, k] int64, top_weights [T, k] (the router's); token_slots [T] int32 (None: no
        adapter rows); num_slots: the slot count L (the sort key's radix)."""
        t, k = top_experts.shape
        radix = num_slots + 1
        tokens = torch.arange(t, device=top_experts.device).repeat_interleave(k)  # [P]
        experts = top_experts.reshape(-1)
        slots = token_slots.long()[tokens] if token_slots is not None else torch.full_like(experts, -1)
        keys = experts * radix + slots + 1
        order = torch.argsort(keys, stable=True)  # token order kept within an (expert, slot) group
        found, lens = torch.unique_consecutive(keys[order], return_counts=True)
        host = torch.cat([found, lens]).tolist()  # the step's one host read per layer
        found, lens = host[: len(host) // 2], host[len(host) // 2:]
        per_expert = [0] * num_experts
        groups, start = [], 0
        for key, n in zip(found, lens):
            per_expert[key // radix] += n
            if key % radix:
                groups.append((start, n, key // radix, key % radix - 1))
            start += n
        bounds = [0]
        for n in per_expert:
            bounds.append(bounds[-1] + n)
        return cls(tokens[order], experts[order].int(), slots[order].int(), top_weights.reshape(-1)[order],
                   tuple(bounds), tuple(groups), rank_bound)
