"""Which Medusa heads draft for which sequence, and the drafts of one step.

The base model's heads come from --speculative-config; an adapter that was uploaded with heads of its own
has them in its slot (set while it is resident), and that adapter's sequences read those. Each sequence's
row is the target's last-layer output at the position whose token it chose last (its last verified one),
computed with its adapter applied, so the heads see the adapter's effect.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from adapters.medusa_format import HeadWeights
from server.engine.kernel_ops import KernelOps
from server.engine.medusa_heads import MedusaHeads

if TYPE_CHECKING:  # the model imports the LoRA slots, which import this
    from server.engine.model import Model


class MedusaProposer:
    def __init__(self, base: MedusaHeads, num_speculative_tokens: int, model: Model) -> None:
        self.base = base
        self.model = model  # its final norm and lm_head turn the heads' rows into drafts
        self.k = num_speculative_tokens
        self.slot_heads: dict[int, MedusaHeads] = {}  # adapter slot -> its own heads, while resident

    def load(self, slot: int, weights: HeadWeights | None) -> None:
        """An adapter entered `slot`: its own heads (on the device, in the base heads' dtype), or the base's."""
        if weights is None:
            self.slot_heads.pop(slot, None)
        else:
            self.slot_heads[slot] = MedusaHeads(weights, self.base.weight.dtype, self.base.weight.device, self.model)

    def evict(self, slot: int) -> None:
        self.slot_heads.pop(slot, None)

    def heads_for(self, slot: int) -> MedusaHeads:
        return self.slot_heads.get(slot, self.base)

    def propose(self, hidden: torch.Tensor, slots: list[int], ops: KernelOps, k: int) -> list[list[int]]:
        """hidden [S, H] (one row per sequence), slots [S] (-1: base) -> each row's first k heads' drafts
        (k <= the configured k). One matmul per distinct set of heads in the step, and one copy to the host
        for all."""
        groups: dict[int, list[int]] = {}
        for r, slot in enumerate(slots):
            groups.setdefault(id(self.heads_for(slot)), []).append(r)
        if len(groups) == 1:  # the usual step: one set of heads, every row
            return self.heads_for(slots[0]).propose(hidden, self.model, ops, k).tolist()
        out = torch.empty(len(slots), k, dtype=torch.long, device=hidden.device)
        for rows in groups.values():
            heads = self.heads_for(slots[rows[0]])
            index = torch.tensor(rows, dtype=torch.long).to(hidden.device, non_blocking=True)
            out.index_copy_(0, index, heads.propose(hidden.index_select(0, index), self.model, ops, k))
        return out.tolist()
