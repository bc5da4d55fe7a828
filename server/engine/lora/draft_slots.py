"""The draft model's LoRA slots (speculative method draft_model): an adapter's draft LoRA
(adapters.draft_lora) sits in the draft model's slot s while the adapter sits in the target's slot s.

The target's LoraSlots decides residency and eviction; this follows it (LoraSlots.draft: loaded and
zeroed with the target slot), so a request's draft rows take the slot its target rows take, and no
second residency policy exists. The buffers are the same LoraSlots machinery over the draft model's
layers, one slot of --max-lora-rank per target slot; a slot whose adapter has no draft LoRA is not
used at all: its rows run the base draft model (slot -1).
"""
from __future__ import annotations

from adapters.packed import PackedLoraAdapter
from server.engine.lora.slots import LoraGroupBuffers, LoraSlots


class DraftLoraSlots:
    def __init__(self, layers: list[dict[str, LoraGroupBuffers]], max_loras: int) -> None:
        self.slots = LoraSlots(layers, max_loras)  # plain LoRA only: no DoRA scales, no vocabulary parts
        self.has = [False] * max_loras  # whether target slot s's adapter brought a draft LoRA

    def load(self, slot: int, draft: PackedLoraAdapter | None) -> None:
        """The adapter entering the target's `slot` brings `draft` (None: its rows use the base draft)."""
        if draft is not None:
            self.slots.place(str(slot), slot, draft)
            self.has[slot] = True

    def evict(self, slot: int) -> None:
        if self.has[slot]:
            self.slots.remove(str(slot))
            self.has[slot] = False

    def draft_slot(self, slot: int) -> int:
        """The draft model's slot for rows of the target's `slot`: the same one, or -1 (base) without a draft LoRA."""
        return slot if slot >= 0 and self.has[slot] else -1
