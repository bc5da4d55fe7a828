"""Preallocated device slot buffers for LoRA weights, and which adapter sits in which slot.

Every slot is sized for `max_lora_rank`; an adapter of smaller rank fills the
leading rows and the rest stay zero. A slot is zero-filled before reuse so a
smaller adapter never reads its predecessor's rows (a bug SGLang shipped).

B is stored rank-major: a slot's first r ranks of A and of B are each one
contiguous block, as in the host tier's packed buffer (adapters.packed), so a
slot load is one host->device copy per staging range plus one batched
device copy, and zeroing a slot is one batched fill.

A slot's views for an adapter's layout (which modules, at which ranks) are
built once per slot and layout and kept, and eviction zeroes exactly the views
the load wrote: building ~2 views per module in Python at every swap made a step
that swapped 8 adapters (a storm of distinct adapters' first uses) spend ~40% of
its time there, while every running stream waited for that step.

A DoRA adapter's slot also gets its per-output scales m / ||W + s B A|| against
this base (server.engine.lora.dora_scales), in a table beside A and B that is 1.0
for plain-LoRA slots and for base rows. On a CPU they are computed once per
host-tier load, on its loader threads (`prepare`), so neither the engine's
step loop nor a later page-in of the same adapter pays for them, and kept in
the adapter's store (Redis) against this base (server.engine.lora.dora_scale_cache),
so a later host-tier load of the version reads them; the server has them
computed when it accepts the version (server.engine.lora.dora_precompute, through
the same hook), so even the first load reads them; on CUDA, where the base
weights live on the device, they are computed as the adapter enters its slot.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch

from adapters.packed import PackedLoraAdapter
from server.engine.lora.dora_scale_cache import DoraScaleCache, ScaleStore
from server.engine.lora.dora_scales import DoraScales
from server.engine.lora.vocab_parts import VocabParts

# Slot-view lists kept per (slot, adapter layout); past this many the oldest go (many distinct layouts:
# rank_pattern adapters), so the cache stays bounded.
MAX_CACHED_LAYOUTS = 256

# An adapter reaches its slot through a device staging buffer of this size, a range of modules at a
# time: the buffer is allocated before the KV pool is sized, and stays small whatever the rank
# (a rank-512 Llama-3-8B adapter is 2.7 GB in bf16).
STAGING_BYTES = 64 << 20

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

    a: torch.Tensor  # [S, L, R, in], stored slot-major as [L, S, R, in]: a slot's slices are one matrix
    b: tuple[torch.Tensor, ...]  # S x [L, n_i, R], stored as [L, R, n_i] (strides (R*n_i, 1, n_i))
    scaling: torch.Tensor  # [S, L] float32, stored as [L, S]: a slot's scalings are contiguous
    offsets: tuple[int, ...]  # column offset of each slice in the fused output
    # [L + 1, sum n_i] float32: each slot's DoRA scale per output column (kernels.dora_scale), 1.0 for a
    # plain-LoRA adapter's slot and for slices a DoRA adapter does not target; row L (all 1.0) is the
    # base rows'.
    dora_scale: torch.Tensor

    @classmethod
    def allocate(cls, in_features: int, out_sizes: tuple[int, ...], max_loras: int, max_rank: int, dtype, device):
        offsets = tuple(sum(out_sizes[:i]) for i in range(len(out_sizes)))
        return cls(
            # Slot-major A lets the CPU shrink read a span of slots, every slice, in one batched matmul.
            a=torch.zeros(max_loras, len(out_sizes), max_rank, in_features, dtype=dtype, device=device).transpose(0, 1),
            b=tuple(torch.zeros(max_loras, max_rank, n, dtype=dtype, device=device).transpose(1, 2)
                    for n in out_sizes),
            scaling=torch.zeros(max_loras, len(out_sizes), dtype=torch.float32, device=device).t(),
            offsets=offsets,
            dora_scale=torch.ones(max_loras + 1, sum(out_sizes), dtype=torch.float32, device=device),
        )


@dataclass(frozen=True)
class SlotStats:
    resident: int  # adapters in slots
    loads: int  # copies into a slot
    hits: int
    evictions: int


class LoraSlots:
    """The device tier: which adapter version sits in which slot; evicts the least recently used idle slot.

    A slot in use by a running request is never evicted. LRU among idle slots,
    because recency predicts the next request under the power-law popularity
    real workloads show. Slots are fixed-size (max rank), so the slot count is
    the byte budget: `max_loras` times one slot's bytes.
    """

    def __init__(self, layers: list[dict[str, LoraGroupBuffers]], max_loras: int,
                 dora: DoraScales | None = None, scale_store: ScaleStore | None = None,
                 vocab: VocabParts | None = None) -> None:
        """dora: computes DoRA adapters' scales against the base weights (None: DoRA adapters are refused);
        scale_store: where computed scales are kept per adapter version (None: computed at every load);
        vocab: where adapters' parts of embed_tokens and lm_head go with their slot (None: not served)."""
        self.vocab = vocab
        self.layers = layers  # per layer: group name -> buffers
        self.max_loras = max_loras
        self.dora = dora
        self.dora_cache = DoraScaleCache(scale_store, dora.weights) if dora is not None else None
        self.slot_of: dict[str, int] = {}
        self.users: dict[str, int] = {}  # running requests per adapter version
        self.idle: OrderedDict[int, str] = OrderedDict()  # idle resident slots, least recent first
        self.free_slots = list(range(max_loras - 1, -1, -1))
        self.slot_ranks = [0] * max_loras  # rank of the adapter in each slot (0 = free); bounds kernel work
        self.slot_dora = [False] * max_loras  # whether each slot holds a DoRA adapter (its scales are not 1)
        # (slot, layout) -> the slot's A and B^T views and scaling entries for adapters of that layout.
        self.target_views: OrderedDict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()
        self.written: dict[int, list[torch.Tensor]] = {}  # slot -> the views its load wrote: what eviction zeroes
        some = layers[0]["o"].a if layers else torch.empty(0)
        # The same on the device, [L] int32, for kernels that stop at each slot's own rank; updated in
        # place, so a captured graph reads the current ranks.
        self.rank_table = torch.zeros(max_loras, dtype=torch.int32, device=some.device)
        self.retiring: set[str] = set()  # removed while in use: evicted when idle
        self.hits = 0
        self.loads = 0
        self.evictions = 0
        cuda = some.is_cuda
        # Explicit device: the caller's thread may not have it current (server.engine.cuda_device).
        self.copy_stream = torch.cuda.Stream(device=some.device) if cuda else None
        groups = [g for layer in layers for g in layer.values()]
        modules = sum(g.a.shape[0] for g in groups)
        slot_elems = sum(g.a[:, 0].numel() + sum(b[0].numel() for b in g.b) for g in groups)
        staging = min(STAGING_BYTES // some.element_size(), slot_elems)
        self.staging = torch.empty(staging, dtype=some.dtype, device=some.device) if cuda else None
        self.scaling_staging = torch.empty(modules, dtype=torch.float32, device=some.device) if cuda else None

    @property
    def num_resident(self) -> int:
        return len(self.slot_of)

    def stats(self) -> SlotStats:
        return SlotStats(self.num_resident, self.loads, self.hits, self.evictions)

    def can_acquire(self, version: str) -> bool:
        return version in self.slot_of or bool(self.free_slots) or bool(self.idle)

    def acquire(self, version: str, adapter: PackedLoraAdapter) -> int:
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
            torch.cuda.current_stream(self.copy_stream.device).wait_stream(self.copy_stream)

    def _evict(self, version: str) -> None:
        slot = self.slot_of.pop(version, None)
        if slot is None:
            return
        self.idle.pop(slot, None)
        if written := self.written.pop(slot):  # the rest of the slot was never written: zero already
            torch._foreach_zero_(written)
        if self.vocab is not None:
            self.vocab.evict(slot)
        if self.slot_dora[slot]:
            for groups in self.layers:
                for buffers in groups.values():
                    buffers.dora_scale[slot].fill_(1.0)
            self.slot_dora[slot] = False
        self.slot_ranks[slot] = 0
        self.rank_table[slot] = 0
        self.free_slots.append(slot)

    def _targets(self, slot: int, adapter: PackedLoraAdapter) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per module of `adapter`, in its order: the slot's A and B^T views, and its scaling entry (kept per
        slot and layout)."""
        key = (slot, adapter.layout)
        found = self.target_views.get(key)
        if found is not None:
            self.target_views.move_to_end(key)
            return found
        found = self.target_views[key] = self._build_targets(slot, adapter)
        if len(self.target_views) > MAX_CACHED_LAYOUTS:
            self.target_views.popitem(last=False)
        return found

    def _build_targets(self, slot: int, adapter: PackedLoraAdapter) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dst, scales = [], []
        for (layer, proj), w in adapter.weights.items():
            group, i = PROJECTION_SLICES[proj]
            buffers = self.layers[layer][group]
            r = w.a.shape[0]
            dst += [buffers.a[i, slot, :r], buffers.b[i][slot, :, :r].t()]
            scales.append(buffers.scaling[i, slot])
        return dst, scales

    def _load(self, slot: int, adapter: PackedLoraAdapter) -> None:
        # Free slots are already zero (initial state, or cleared by _evict). On CUDA the copies run on a
        # side stream from pinned host memory, overlapping the running batch's compute.
        assert isinstance(adapter, PackedLoraAdapter), "adapters reach slots through the host tier"
        self.loads += 1
        if adapter.vocab is not None:
            assert self.vocab is not None, "an engine that serves vocabulary parts builds its slots with VocabParts"
            self.vocab.load(slot, adapter)
        self.slot_ranks[slot] = adapter.rank
        self.rank_table[slot] = adapter.rank
        dst, scales = self._targets(slot, adapter)
        self.written[slot] = dst + scales
        src = adapter.tensors()
        if not src:  # parts of embed_tokens and lm_head only (self.vocab's): nothing for the projections
            return
        if self.copy_stream is None:
            torch._foreach_copy_(dst, src)
            torch._foreach_copy_(scales, adapter.scaling_entries)
            self._load_dora(slot, adapter)
            return
        # The slot was zeroed, and last read, on the compute stream: copy only after that.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.copy_stream.device))
        with torch.cuda.stream(self.copy_stream):
            for first, last in adapter.spans(self.staging.numel()):
                lo, hi = adapter.extent(first, last)
                part = slice(2 * first, 2 * last)
                if hi - lo > self.staging.numel():  # one module larger than the staging buffer
                    for d, s_ in zip(dst[part], src[part]):
                        d.copy_(s_, non_blocking=True)
                    continue
                stage = self.staging[: hi - lo]
                stage.copy_(adapter.flat[lo:hi], non_blocking=True)  # one copy for the whole range
                staged = [stage[o - lo: o - lo + s_.numel()].view(s_.shape)
                          for o, s_ in zip(adapter.offsets[part], src[part])]
                torch._foreach_copy_(dst[part], staged)
            n = len(scales)
            self.scaling_staging[:n].copy_(adapter.scalings, non_blocking=True)
            torch._foreach_copy_(scales, list(self.scaling_staging[:n].unbind()))
            self._load_dora(slot, adapter)  # on the copy stream, after the slot's A and B

    def prepare(self, adapter: PackedLoraAdapter, version: str | None = None) -> PackedLoraAdapter:
        """The host tier's hook on a CPU engine (its loader threads): a DoRA adapter's scales, in place of its
        magnitudes, read from the store for `version` (None: not a stored version), else computed now from
        its packed A and B (the values its slot will hold) and stored."""
        if not adapter.use_dora or adapter.magnitudes_are_scales:
            return adapter
        assert self.dora is not None, "an engine that serves DoRA adapters builds its slots with DoraScales"
        stored = None if version is None else self.dora_cache.read(version, adapter.magnitudes.numel())
        if stored is not None:
            adapter.magnitudes.copy_(stored)  # [sum out] float32, module order, as computed below
            return dataclasses.replace(adapter, magnitudes_are_scales=True)
        for (layer, proj), w in adapter.weights.items():
            if w.magnitude is not None:
                group, i = PROJECTION_SLICES[proj]
                row = self.layers[layer][group].offsets[i]
                self.dora.compute(layer, group, row, w.a, w.b, w.scaling, w.magnitude, w.magnitude)
        if version is not None:
            self.dora_cache.write(version, adapter.magnitudes)
        return dataclasses.replace(adapter, magnitudes_are_scales=True)

    def _load_dora(self, slot: int, adapter: PackedLoraAdapter) -> None:
        """A DoRA adapter's scales into the slot's table: copied when the host tier computed them, else
        computed from the slot's A and B just copied in (the values the forward uses)."""
        if not adapter.use_dora:
            return
        assert self.dora is not None, "an engine that serves DoRA adapters builds its slots with DoraScales"
        self.slot_dora[slot] = True
        magnitudes = adapter.magnitudes.to(self.rank_table.device, non_blocking=True)  # [sum out] float32
        at = 0
        for (layer, proj), w in adapter.weights.items():
            if w.magnitude is None:
                continue
            group, i = PROJECTION_SLICES[proj]
            buffers = self.layers[layer][group]
            n, r = w.b.shape
            lo = buffers.offsets[i]
            dst = buffers.dora_scale[slot, lo: lo + n]
            if adapter.magnitudes_are_scales:
                dst.copy_(magnitudes[at: at + n])
            else:
                self.dora.compute(layer, group, lo, buffers.a[i, slot, :r], buffers.b[i][slot, :, :r], w.scaling,
                                  magnitudes[at: at + n], dst)
            at += n
