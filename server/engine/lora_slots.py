"""Preallocated device slot buffers for LoRA weights, and which adapter sits in which slot.

Every slot is sized for `max_lora_rank`; an adapter of smaller rank fills the
leading rows and the rest stay zero. A slot is zero-filled before reuse so a
smaller adapter never reads its predecessor's rows (a bug SGLang shipped).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from adapters.format import LoraAdapter

# projection -> (group, slice within the group's fused output)
PROJECTION_SLICES = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}


@dataclass
class LoraGroupBuffers:
    """One fused linear layer's slots: S slices sharing an input."""

    a: torch.Tensor  # [S, L, R, in]
    b: tuple[torch.Tensor, ...]  # S x [L, n_i, R]
    scaling: torch.Tensor  # [S, L] float32
    offsets: tuple[int, ...]  # column offset of each slice in the fused output

    @classmethod
    def allocate(cls, in_features: int, out_sizes: tuple[int, ...], max_loras: int, max_rank: int, dtype, device):
        offsets = tuple(sum(out_sizes[:i]) for i in range(len(out_sizes)))
        return cls(
            a=torch.zeros(len(out_sizes), max_loras, max_rank, in_features, dtype=dtype, device=device),
            b=tuple(torch.zeros(max_loras, n, max_rank, dtype=dtype, device=device) for n in out_sizes),
            scaling=torch.zeros(len(out_sizes), max_loras, dtype=torch.float32, device=device),
            offsets=offsets,
        )

    def clear(self, slot: int) -> None:
        self.a[:, slot].zero_()
        for b in self.b:
            b[slot].zero_()
        self.scaling[:, slot] = 0.0

    def nbytes(self) -> int:
        return self.a.nbytes + sum(b.nbytes for b in self.b) + self.scaling.nbytes


class AdapterSlots:
    """Maps adapter version ids to device slots; evicts the least recently used idle slot.

    LRU among idle slots: a slot in use by a running request is never evicted,
    and recency is a good predictor of the next request under the power-law
    popularity real workloads show.
    """

    def __init__(self, layers: list[dict[str, LoraGroupBuffers]], max_loras: int) -> None:
        self.layers = layers  # per layer: group name -> buffers
        self.max_loras = max_loras
        self.adapters: dict[str, LoraAdapter] = {}  # registered (host copy), by version id
        self.slot_of: dict[str, int] = {}
        self.users: dict[str, int] = {}  # running requests per adapter id
        self.idle: OrderedDict[int, str] = OrderedDict()  # idle resident slots, least recent first
        self.free_slots = list(range(max_loras - 1, -1, -1))
        self.retiring: set[str] = set()  # unregistered while in use: dropped when idle
        self.loads = 0

    def register(self, adapter_id: str, adapter: LoraAdapter) -> None:
        self.adapters[adapter_id] = adapter
        self.retiring.discard(adapter_id)

    def unregister(self, adapter_id: str) -> None:
        """Forget an adapter; if requests still use it, once they finish."""
        if self.users.get(adapter_id):
            self.retiring.add(adapter_id)
            return
        self.adapters.pop(adapter_id, None)
        self._evict(adapter_id)

    def is_registered(self, adapter_id: str) -> bool:
        return adapter_id in self.adapters and adapter_id not in self.retiring

    def can_acquire(self, adapter_id: str) -> bool:
        return adapter_id in self.slot_of or bool(self.free_slots) or bool(self.idle)

    def acquire(self, adapter_id: str) -> int:
        """Pin the adapter in a slot for one more request; load it if not resident."""
        assert adapter_id in self.adapters, f"adapter {adapter_id} not registered"
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            if not self.free_slots:
                _, victim = self.idle.popitem(last=False)
                self._evict(victim)
            slot = self.free_slots.pop()
            self._load(slot, self.adapters[adapter_id])
            self.slot_of[adapter_id] = slot
        self.idle.pop(slot, None)
        self.users[adapter_id] = self.users.get(adapter_id, 0) + 1
        return slot

    def release(self, adapter_id: str) -> None:
        self.users[adapter_id] -= 1
        if self.users[adapter_id] == 0:
            del self.users[adapter_id]
            if adapter_id in self.retiring:
                self.retiring.discard(adapter_id)
                self.adapters.pop(adapter_id, None)
                self._evict(adapter_id)
            else:
                self.idle[self.slot_of[adapter_id]] = adapter_id

    @property
    def num_resident(self) -> int:
        return len(self.slot_of)

    def _evict(self, adapter_id: str) -> None:
        slot = self.slot_of.pop(adapter_id, None)
        if slot is None:
            return
        self.idle.pop(slot, None)
        for groups in self.layers:
            for buffers in groups.values():
                buffers.clear(slot)
        self.free_slots.append(slot)

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        # Free slots are already zero (initial state, or cleared by _evict).
        self.loads += 1
        for (layer, proj), w in adapter.weights.items():
            group, i = PROJECTION_SLICES[proj]
            buffers = self.layers[layer][group]
            r = w.a.shape[0]
            buffers.a[i, slot, :r].copy_(w.a)
            buffers.b[i][slot, :, :r].copy_(w.b)
            buffers.scaling[i, slot] = w.scaling
