"""The draft model's LoRA slots (speculative method draft_model): an adapter's draft LoRA
(adapters.draft_lora) sits in the draft model's slot s while the adapter sits in the target's slot s.

The target's LoraSlots decides residency and eviction; this follows it (LoraSlots.draft: loaded and
zeroed with the target slot), so a request's draft rows take the slot its target rows take, and no
second residency policy exists. The buffers are the same LoraSlots machinery over the draft model's
layers, one slot of --max-lora-rank per target slot; a slot whose adapter has no draft LoRA is not
used at all: its rows run the base draft model (slot -1).

Most adapters carry no draft LoRA, so the buffers hold no memory until the first one that does enters a
slot: the draft model is built over stand-ins of their shapes (server.engine.unified_buffer.unallocated),
which no forward reads while every row is slot -1, and they are allocated then, in place (the model holds
the group objects), with the LoraSlots over them. `allocated_bytes` (/admin/engine's slots.draft_bytes)
says which. Allocated after the KV pool was sized, on CUDA they come out of the headroom the pool left;
where that allocation fails the draft LoRAs stay off (their rows run the base draft, which the target
verifies as any draft) and a warning says so once.
"""
from __future__ import annotations

import logging

import torch

from adapters.packed import PackedLoraAdapter
from kernels.metadata import LoraBatch
from server.engine.lora.slots import LoraGroupBuffers, LoraSlots
from server.engine.unified_buffer import unallocated

log = logging.getLogger(__name__)


class DraftLoraSlots:
    def __init__(self, layers: list[dict[str, LoraGroupBuffers]], max_loras: int) -> None:
        """layers: the draft model's LoRA groups, their A and B stand-ins holding no memory."""
        self.layers = layers
        self.max_loras = max_loras
        self.slots: LoraSlots | None = None  # plain LoRA only (no DoRA scales, no vocabulary parts); None: unallocated
        self.failed = False  # the allocation failed (out of device memory): draft LoRAs stay off
        self.has = [False] * max_loras  # whether target slot s's adapter brought a draft LoRA

    @property
    def allocated_bytes(self) -> int:
        """Device bytes the slots' A and B hold: 0 until an adapter with a draft LoRA first loads."""
        if self.slots is None:
            return 0
        return sum(g.slot_numel * self.max_loras * g.a.element_size() for groups in self.layers
                   for g in groups.values())

    def load(self, slot: int, draft: PackedLoraAdapter | None) -> None:
        """The adapter entering the target's `slot` brings `draft` (None: its rows use the base draft)."""
        if draft is None or not self._allocate():
            return
        self.slots.place(str(slot), slot, draft)
        self.has[slot] = True

    def evict(self, slot: int) -> None:
        if self.has[slot]:
            self.slots.remove(str(slot))
            self.has[slot] = False

    def draft_slot(self, slot: int) -> int:
        """The draft model's slot for rows of the target's `slot`: the same one, or -1 (base) without a draft LoRA."""
        return slot if slot >= 0 and self.has[slot] else -1

    def sync(self) -> None:
        """Make the compute stream wait for draft LoRAs copied in this step (CUDA: the slots' copy stream)."""
        if self.slots is not None:
            self.slots.sync()

    def lora_batch(self, token_slots: list[int], device: torch.device) -> LoraBatch:
        """The draft forward's LoRA rows (every one -1 until a draft LoRA has loaded)."""
        if self.slots is None:
            return LoraBatch.build(token_slots, device)
        return LoraBatch.build(token_slots, device, self.slots.slot_ranks, self.slots.rank_table)

    def _allocate(self) -> bool:
        """The buffers' memory, at the first draft LoRA; whether the slots are there."""
        if self.slots is not None or self.failed:
            return self.slots is not None
        try:
            for groups in self.layers:
                for group in groups.values():
                    group.repage(self.max_loras, torch.zeros)
            self.slots = LoraSlots(self.layers, self.max_loras)
        except torch.OutOfMemoryError:
            log.warning("no device memory left for the draft model's LoRA slots: adapters' draft LoRAs are not "
                        "used (their requests draft with the base draft model)")
            self.failed = True
            for groups in self.layers:  # stand-ins again: what was allocated before the failure goes
                for group in groups.values():
                    group.repage(self.max_loras, unallocated)
            return False
        log.info("draft model's LoRA slots allocated at the first draft LoRA: %d bytes", self.allocated_bytes)
        return True
