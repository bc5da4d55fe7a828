"""Preallocated device slot buffers for LoRA weights, and which adapter sits in which slot.

Every slot is sized for `max_lora_rank`; an adapter of smaller rank fills the
leading rows and the rest stay zero. A slot is zero-filled before reuse so a
smaller adapter never reads its predecessor's rows (a bug SGLang shipped).
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
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


class AdapterSlots:
    """The device tier: which adapter version sits in which slot; evicts the least recently used idle slot.

    A slot in use by a running request is never evicted. LRU among idle slots,
    because recency predicts the next request under the power-law popularity
    real workloads show. Slots are fixed-size (max rank), so the slot count is
    the byte budget: `max_loras` times one slot's bytes.
    """

    def __init__(self, layers: list[dict[str, LoraGroupBuffers]], max_loras: int) -> None:
        self.layers = layers  # per layer: group name -> buffers
        self.max_loras = max_loras
        self.slot_of: dict[str, int] = {}
        self.users: dict[str, int] = {}  # running requests per adapter version
        self.idle: OrderedDict[int, str] = OrderedDict()  # idle resident slots, least recent first
        self.free_slots = list(range(max_loras - 1, -1, -1))
        self.slot_ranks = [0] * max_loras  # rank of the adapter in each slot (0 = free); bounds kernel work
        self.retiring: set[str] = set()  # removed while in use: evicted when idle
        self.hits = 0
        self.loads = 0
        self.evictions = 0
        self.copy_stream = torch.cuda.Stream() if layers and layers[0]["o"].a.is_cuda else None

    @property
    def num_resident(self) -> int:
        return len(self.slot_of)

    def can_acquire(self, version: str) -> bool:
        return version in self.slot_of or bool(self.free_slots) or bool(self.idle)

    def acquire(self, version: str, adapter: LoraAdapter) -> int:
        """Pin `version` in a slot for one more request, copying it in from the host tier if needed."""
        slot = self.slot_of.get(version)
        if slot is None:
            if not self.free_slots:
                _, victim = self.idle.popitem(last=False)
                self._evict(victim)
                self.evictions += 1
            slot = self.free_slots.pop()
            self._load(slot, adapter)
            self.slot_of[version] = slot
        else:
            self.hits += 1
        self.idle.pop(slot, None)
        self.users[version] = self.users.get(version, 0) + 1
        return slot

    def release(self, version: str) -> None:
        self.users[version] -= 1
        if self.users[version] == 0:
            del self.users[version]
            if version in self.retiring:
                self.retiring.discard(version)
                self._evict(version)
            else:
                self.idle[self.slot_of[version]] = version

    def remove(self, version: str) -> None:
        """A deleted or replaced version leaves its slot now, or when its last request finishes."""
        if self.users.get(version):
            self.retiring.add(version)
        else:
            self._evict(version)

    def sync(self) -> None:
        """Make the compute stream wait for slot copies issued on the copy stream."""
        if self.copy_stream is not None:
            torch.cuda.current_stream().wait_stream(self.copy_stream)

    def _evict(self, version: str) -> None:
        slot = self.slot_of.pop(version, None)
        if slot is None:
            return
        self.idle.pop(slot, None)
        for groups in self.layers:
            for buffers in groups.values():
                buffers.clear(slot)
        self.slot_ranks[slot] = 0
        self.free_slots.append(slot)

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        # Free slots are already zero (initial state, or cleared by _evict). On CUDA the copies
        # run on a side stream from pinned host memory, overlapping the running batch's compute.
        self.loads += 1
        self.slot_ranks[slot] = adapter.rank
        if self.copy_stream is not None:
            # The slot was zeroed, and last read, on the compute stream: copy only after that.
            self.copy_stream.wait_stream(torch.cuda.current_stream())
        stream = torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else nullcontext()
        with stream:
            for (layer, proj), w in adapter.weights.items():
                group, i = PROJECTION_SLICES[proj]
                buffers = self.layers[layer][group]
                r = w.a.shape[0]
                buffers.a[i, slot, :r].copy_(w.a, non_blocking=True)
                buffers.b[i][slot, :, :r].copy_(w.b, non_blocking=True)
                buffers.scaling[i, slot] = w.scaling
