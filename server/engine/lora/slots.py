"""Preallocated device slot buffers for LoRA weights, which adapter sits in which slot (LoraSlots), and
which of a request's tokens take its adapter's slot under an activated LoRA (adapter_from, token_slots).

Every slot is sized for `max_lora_rank`; an adapter of smaller rank fills the
leading rows and the rest stay zero. A slot is zero-filled before reuse so a
smaller adapter never reads its predecessor's rows (a bug SGLang shipped).
With `--lora-page-rows` (server.engine.lora.paging) A and B are pages of rank
rows instead, an adapter holding as many as its rank needs, anywhere in the
pool, named by its slot's row of the page table (kernels.lora_pages); a slot is
then an adapter entry: its scalings, DoRA scales and rank. Pages are zeroed on
eviction alike, and table entries past an adapter's pages name the zero page.

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

Activated LoRA in the engine (adapter_from, token_slots, base_blocks): which of a request's tokens run
with its adapter, and which KV is the base's.

A request's *activation point* (`SequenceGroup.adapter_from`) is the first
position its adapter applies to: 0 for a plain LoRA (and irrelevant for the
base model), the start of the invocation sequence's last occurrence in the
prompt for an aLoRA, NOT_INVOKED when the prompt lacks it (PEFT's rule,
adapters.activation). It is found when the request is admitted, the adapter
being in the host tier then, and depends on the prompt alone, so preemption
and forks keep it.

Tokens before the point take the no-adapter slot (-1): they run as base-model
rows in the same batch, whatever chunk they fall in. KV blocks wholly before
it are the base model's, and the prefix cache keys them so
(server.engine.block_manager); blocks from it on are the adapter's, keyed on
its version *and* the point, since the same tokens with the adapter switched
on elsewhere give other K/V.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence
from weakref import WeakKeyDictionary

import torch

from adapters.activation import activation_start, invocation_tokens
from adapters.format import LoraAdapter
from adapters.packed import PackedLoraAdapter
from server.engine.lora.dora_scale_cache import DoraScaleCache, ScaleStore
from server.engine.lora.dora_scales import DoraScales
from server.engine.lora.expert_buffers import expert_target
from server.engine.lora.paging import LoraPaging
from server.engine.lora.vocab_parts import VocabParts
from server.engine.medusa_proposer import MedusaProposer

if TYPE_CHECKING:
    from server.engine.lora.draft_slots import DraftLoraSlots
    from server.engine.unified_memory import PageUnits


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
    # [D + 1, sum n_i] float32: each slot's DoRA scale per output column (kernels.dora_scale), 1.0 for a
    # plain-LoRA adapter's slot and for slices a DoRA adapter does not target; row D (all 1.0) is the
    # base rows' and that of slots D and on (D = L unless paged: server.engine.lora.paging).
    dora_scale: torch.Tensor

    @classmethod
    def allocate(cls, in_features: int, out_sizes: tuple[int, ...], max_loras: int, max_rank: int, dtype, device,
                 pages: int | None = None, dora_entries: int | None = None, zeros: Callable = torch.zeros):
        """max_loras adapter entries (scalings), the first dora_entries of them with DoRA scales (None: all);
        A and B as `pages` pages of max_rank rows each (None: one per entry, the slots; paged: max_rank is
        the page's rows, kernels.lora_pages), made by `zeros(shape, dtype=, device=)`."""
        pages = max_loras if pages is None else pages
        dora_entries = max_loras if dora_entries is None else dora_entries
        offsets = tuple(sum(out_sizes[:i]) for i in range(len(out_sizes)))
        a, b = cls.page_tensors(in_features, out_sizes, pages, max_rank, dtype, device, zeros)
        return cls(
            a=a,
            b=b,
            scaling=torch.zeros(max_loras, len(out_sizes), dtype=torch.float32, device=device).t(),
            offsets=offsets,
            dora_scale=torch.ones(dora_entries + 1, sum(out_sizes), dtype=torch.float32, device=device),
        )

    @staticmethod
    def page_tensors(in_features: int, out_sizes: tuple[int, ...], pages: int, rows: int, dtype, device,
                     zeros: Callable) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """A and the B's of `pages` pages (or slots) of `rows` rank rows, made by `zeros`, A then each B in
        order (a page's bytes in that order: server.engine.unified_buffer carves them so)."""
        # Slot-major A lets the CPU shrink read a span of slots, every slice, in one batched matmul.
        a = zeros((pages, len(out_sizes), rows, in_features), dtype=dtype, device=device).transpose(0, 1)
        return a, tuple(zeros((pages, rows, n), dtype=dtype, device=device).transpose(1, 2) for n in out_sizes)

    def repage(self, pages: int, zeros: Callable) -> None:
        """A and B as `pages` pages made by `zeros` in place of the ones allocated (the model holds this
        object: --unified-memory's pages come from the pool's buffer once it is sized)."""
        num_slices, _, rows, in_features = self.a.shape
        self.a, self.b = self.page_tensors(in_features, tuple(b.shape[1] for b in self.b), pages, rows,
                                           self.a.dtype, self.a.device, zeros)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.a, *self.b, self.scaling, self.dora_scale

    @property
    def num_modules(self) -> int:
        return self.a.shape[0]

    @property
    def slot_numel(self) -> int:
        """Elements one slot holds (A and B^T of every slice)."""
        return self.a[:, 0].numel() + sum(b[0].numel() for b in self.b)


@dataclass(frozen=True)
class SlotStats:
    resident: int  # adapters in slots
    loads: int  # copies into a slot
    hits: int
    evictions: int
    pages_used: int = 0  # pages resident adapters hold (slots when not paged)
    pages_total: int = 0  # pages of the pool, the zero page excluded
    pinned: int = 0  # versions pinned on the device
    draft_bytes: int = 0  # the draft model's LoRA slots' device bytes: 0 until a draft LoRA first loads


class PinLimitError(ValueError):
    """A tenant already pins as many adapters as `max_pinned_adapters_per_tenant` allows."""

    def __init__(self, tenant: str | None, limit: int) -> None:
        super().__init__(f"tenant {tenant!r} already pins {limit} adapters: the limit "
                         f"max_pinned_adapters_per_tenant is {limit}")
        self.limit = limit


# What bringing an idle adapter back costs, per page, by where it would come from: the host tier (a
# device copy) or the store only (a fetch, a parse and a pack first). Eviction weighs idle time by it.
RELOAD_COST = {"host": 1.0, "store": 4.0}


class LoraSlots:
    """The device tier: which adapter version sits in which slot (an adapter entry) and, when paged, which
    pages hold its rank rows; evicts idle adapters by idle time weighted by the cost of bringing them back.

    A slot in use by a running request is never evicted, nor is a pinned one. Among the others the victim
    has the largest idle time (requests admitted since its last use) per unit of reload cost: pages (its
    rank) times RELOAD_COST of the tier it would come back from. Equal costs make it LRU, because
    recency predicts the next request under the power-law popularity real workloads show.

    Not paged (server.engine.lora.paging), slots are fixed-size (max rank) and the slot count is the byte
    budget: `max_loras` times one slot's bytes. Paged, an adapter of rank r holds ceil(r / page rows)
    pages of any free ones (not contiguous: loading after churn never needs compaction), and its entry's
    row of `page_table` names them; the rest of the row names the zero page.
    """

    def __init__(self, layers: list[dict[str, LoraGroupBuffers]], max_loras: int,
                 dora: DoraScales | None = None, scale_store: ScaleStore | None = None,
                 paging: LoraPaging | None = None, max_pins_per_tenant: int = 0,
                 vocab: VocabParts | None = None) -> None:
        """dora: computes DoRA adapters' scales against the base weights (None: DoRA adapters are refused);
        scale_store: where computed scales are kept per adapter version (None: computed at every load);
        paging: the layout the buffers were allocated for (None: max_loras slots); max_pins_per_tenant:
        adapters one tenant may pin on the device; vocab: where adapters' parts of embed_tokens and lm_head
        go with their slot (None: not served)."""
        self.vocab = vocab
        # Adapters' own Medusa heads go with their slot too (server.engine.medusa_proposer; set by use_medusa).
        self.medusa: MedusaProposer | None = None
        # Adapters' draft LoRAs go with their slot into the draft model's (server.engine.lora.draft_slots).
        self.draft: DraftLoraSlots | None = None
        self.layers = layers  # per layer: group name -> buffers
        some = layers[0]["o"].a if layers else torch.empty(0, 0, 1, 0)
        self.paging = paging or LoraPaging.slots(max_loras, some.shape[2])
        assert self.paging.entries == max_loras, (self.paging, max_loras)
        self.max_loras = max_loras
        self.max_pins_per_tenant = max_pins_per_tenant
        self.dora = dora
        # Without DoraScales, an empty cache (no store, no weights): its stats are what snapshots read.
        self.dora_cache = (DoraScaleCache(scale_store, dora.weights) if dora is not None
                           else DoraScaleCache(None, []))
        self.slot_of: dict[str, int] = {}
        self.users: dict[str, int] = {}  # running requests per adapter version
        self.idle: OrderedDict[int, str] = OrderedDict()  # idle resident slots, least recent first
        self.free_slots = list(range(max_loras - 1, -1, -1))
        # Paged: the pool's free pages (page 0, the zero page, is never handed out); slot -> its pages.
        self.free_pages = list(range(self.paging.pages - 1, 0, -1)) if self.paging.paged else []
        self.slot_pages: dict[int, tuple[int, ...]] = {}
        # --unified-memory: the pool's units behind the pages (server.engine.unified_memory; use_pool sets it).
        self.units: PageUnits | None = None
        self.pinned: dict[str, str | None] = {}  # version -> the tenant that pinned it
        self.released_at: dict[str, int] = {}  # version -> `tick` when it went idle
        self.tick = 0  # admissions so far: the clock idle time is counted in
        # Where a version would come back from if evicted (the host tier sets it: server.engine.engine_startup).
        self.reload_tier: Callable[[str], str] = lambda version: "host"
        self.slot_ranks = [0] * max_loras  # rank of the adapter in each slot (0 = free); bounds kernel work
        self.slot_dora = [False] * max_loras  # whether each slot holds a DoRA adapter (its scales are not 1)
        # (pages, layout) -> the views of A and B^T per module tensor, and the slot's scaling entries.
        self.target_views: OrderedDict[tuple, tuple[list[list[torch.Tensor]], list[torch.Tensor]]] = OrderedDict()
        self.written: dict[int, list[torch.Tensor]] = {}  # slot -> the views its load wrote: what eviction zeroes
        # adapter -> its tensors cut into pages (while the host tier holds the adapter)
        self.split_sources: WeakKeyDictionary[PackedLoraAdapter, list[torch.Tensor]] = WeakKeyDictionary()
        # The same on the device, [L] int32, for kernels that stop at each slot's own rank; updated in
        # place, so a captured graph reads the current ranks.
        self.rank_table = torch.zeros(max_loras, dtype=torch.int32, device=some.device)
        # Paged: [L, pages per slot] int32, each slot's pages (kernels.lora_pages), updated in place alike.
        self.page_table = torch.zeros(max_loras, self.paging.pages_per_entry, dtype=torch.int32,
                                      device=some.device) if self.paging.paged else None
        self.retiring: set[str] = set()  # removed while in use: evicted when idle
        self.hits = 0
        self.loads = 0
        self.evictions = 0
        cuda = some.is_cuda
        # Explicit device: the caller's thread may not have it current (server.engine.cuda_device).
        self.copy_stream = torch.cuda.Stream(device=some.device) if cuda else None
        groups = [g for layer in layers for g in layer.values()]
        modules = sum(g.num_modules for g in groups)
        slot_elems = sum(g.slot_numel for g in groups) * self.paging.pages_per_entry
        staging = min(STAGING_BYTES // some.element_size(), slot_elems)
        self.staging = torch.empty(staging, dtype=some.dtype, device=some.device) if cuda else None
        self.scaling_staging = torch.empty(modules, dtype=torch.float32, device=some.device) if cuda else None

    def use_pool(self, units: PageUnits, pages: int) -> None:
        """--unified-memory (startup, before any load): the pages are the pool's, `pages` of them (the zero
        page included), each lent by `units` with the KV blocks that are its memory."""
        assert not self.slot_of, "the pool is set before any adapter loads"
        self.units = units
        self.paging = dataclasses.replace(self.paging, pages=pages)
        self.free_pages = list(range(pages - 1, 0, -1))

    @property
    def num_resident(self) -> int:
        return len(self.slot_of)

    def stats(self) -> SlotStats:
        paged = self.paging.paged
        total = self.paging.pages - 1 if paged else self.max_loras
        used = total - len(self.free_pages) if paged else self.num_resident
        return SlotStats(self.num_resident, self.loads, self.hits, self.evictions, used, total, len(self.pinned),
                         self.draft.allocated_bytes if self.draft is not None else 0)

    def pages_for(self, adapter: PackedLoraAdapter) -> int:
        """Pages `adapter` holds on the device (1 when not paged: a slot)."""
        return self.paging.pages_for(max((r for _, r in adapter.layout), default=1))

    def can_acquire(self, version: str, adapter: PackedLoraAdapter | None = None, pages: bool = True) -> bool:
        """Whether `version` is resident or can be made so now, evicting only idle unpinned adapters
        (adapter: its weights, for the pages it needs; None: one page; pages False: an entry only, the
        pages being the caller's to make room for: --unified-memory's scheduler)."""
        if version in self.slot_of:
            return True
        dora = adapter is not None and adapter.use_dora
        victims = [slot for slot, v in self.idle.items() if v not in self.pinned]
        rows = self.paging.dora_entries
        if self._free_entry(dora) is None and not any(s < rows or not dora for s in victims):
            return False
        if not self.paging.paged or not pages:
            return True
        need = 1 if adapter is None else self.pages_for(adapter)
        return self._page_room() + sum(len(self.slot_pages[s]) for s in victims) >= need

    def acquire(self, version: str, adapter: PackedLoraAdapter) -> int:
        """Pin `version` in a slot for one more request, copying it in from the host tier if needed."""
        self.tick += 1
        slot = self.slot_of.get(version)
        if slot is None:
            need = self.pages_for(adapter)
            while (entry := self._free_entry(adapter.use_dora)) is None or (
                    self.paging.paged and self._page_room() < need):
                victim = self._victim(dora_row=adapter.use_dora and entry is None)
                assert victim is not None, "acquire without room: can_acquire first"
                self._evict(victim)
                self.evictions += 1
            slot = self.free_slots.pop(entry)
            if self.units is not None:  # the pages whose units the pool lent (server.engine.unified_memory)
                pages = self.units.take(slot, need)
                self.free_pages = [p for p in self.free_pages if p not in pages]
            else:
                pages = tuple(self.free_pages.pop() for _ in range(need)) if self.paging.paged else (slot,)
            self._load(slot, pages, adapter)
            self.slot_of[version] = slot
        else:
            self.hits += 1
        self.idle.pop(slot, None)
        self.users[version] = self.users.get(version, 0) + 1
        return slot

    def place(self, version: str, slot: int, adapter: PackedLoraAdapter) -> None:
        """Load `version` into the free, unpaged `slot` chosen by the caller (the draft model's slots follow
        the target's: server.engine.lora.draft_slots); it stays idle there until removed."""
        assert not self.paging.paged and slot in self.free_slots and version not in self.slot_of
        self.free_slots.remove(slot)
        self._load(slot, (slot,), adapter)
        self.slot_of[version] = slot

    def _page_room(self) -> int:
        """Pages a load can take without evicting: the free ones, or under --unified-memory as many as the
        pool's aligned groups of units nobody holds make."""
        return len(self.free_pages) if self.units is None else self.units.room()

    def evict_idle(self, keep: str | None = None) -> bool:
        """Evict the idle unpinned adapter eviction would choose (never `keep`): its pages' memory for KV
        blocks (--unified-memory); whether there was one."""
        victim = self._victim(keep=keep)
        if victim is None:
            return False
        self._evict(victim)
        self.evictions += 1
        return True

    def _free_entry(self, dora: bool) -> int | None:
        """Index in free_slots of the entry an adapter takes: one with a DoRA scale row for a DoRA adapter,
        preferably one without for the others (they are the DoRA adapters' only room); None if none fits."""
        rows = self.paging.dora_entries
        fits = [i for i, s in enumerate(self.free_slots) if (s < rows) == dora]
        if not fits and not dora:
            fits = list(range(len(self.free_slots)))
        return fits[-1] if fits else None

    def _victim(self, dora_row: bool = False, keep: str | None = None) -> str | None:
        """The idle unpinned version with the most idle time per unit of reload cost (the least recent first
        among equals), among those holding a DoRA scale row when `dora_row`; None if there is none."""
        best, best_score = None, -1.0
        for slot, version in self.idle.items():  # least recent first: a tie keeps the older
            if version in self.pinned or version == keep or (dora_row and slot >= self.paging.dora_entries):
                continue
            cost = len(self.slot_pages[slot]) * RELOAD_COST[self.reload_tier(version)]
            score = (self.tick - self.released_at.get(version, 0) + 1) / cost
            if score > best_score:
                best, best_score = version, score
        return best

    def release(self, version: str) -> None:
        self.users[version] -= 1
        if self.users[version] == 0:
            del self.users[version]
            if version in self.retiring:
                self.retiring.discard(version)
                self._evict(version)
            else:
                self.idle[self.slot_of[version]] = version
                self.released_at[version] = self.tick

    def remove(self, version: str) -> None:
        """A deleted or replaced version leaves its slot now, or when its last request finishes; its pin
        goes with it."""
        self.pinned.pop(version, None)
        if self.users.get(version):
            self.retiring.add(version)
        else:
            self._evict(version)

    def pin(self, version: str, tenant: str | None) -> None:
        """Keep `version` on the device once loaded, never evicted, until unpinned or removed;
        PinLimitError past max_pins_per_tenant pins for `tenant` (pinning twice is one pin)."""
        if version in self.pinned:
            return
        if sum(1 for t in self.pinned.values() if t == tenant) >= self.max_pins_per_tenant:
            raise PinLimitError(tenant, self.max_pins_per_tenant)
        self.pinned[version] = tenant

    def unpin(self, version: str) -> bool:
        """Let `version` be evicted again; whether it was pinned."""
        return self.pinned.pop(version, None) is not None

    def sync(self) -> None:
        """Make the compute stream wait for slot copies issued on the copy stream."""
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.copy_stream.device).wait_stream(self.copy_stream)

    def _evict(self, version: str) -> None:
        slot = self.slot_of.pop(version, None)
        if slot is None:
            return
        self.idle.pop(slot, None)
        self.released_at.pop(version, None)
        if written := self.written.pop(slot):  # the rest of the pages was never written: zero already
            torch._foreach_zero_(written)
        if self.vocab is not None:
            self.vocab.evict(slot)
        if self.medusa is not None:
            self.medusa.evict(slot)
        if self.draft is not None:
            self.draft.evict(slot)
        if self.slot_dora[slot]:
            for groups in self.layers:
                for buffers in groups.values():
                    if buffers.dora_scale is not None:  # expert groups have none (no DoRA there)
                        buffers.dora_scale[slot].fill_(1.0)
            self.slot_dora[slot] = False
        self.slot_ranks[slot] = 0
        self.rank_table[slot] = 0
        pages = self.slot_pages.pop(slot)
        if self.units is not None:
            self.units.give(slot)
        if self.page_table is not None:
            self.page_table[slot] = 0  # the zero page: a stale entry reads zeros, never the next holder's rows
            self.free_pages.extend(reversed(pages))
        self.free_slots.append(slot)

    def _targets(self, slot: int, pages: tuple[int, ...], adapter: PackedLoraAdapter
                 ) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        """Per module tensor of `adapter` (A, then B^T, module by module): the views of its pages' rows, one
        per page; and per module the slot's scaling entry. Kept per (slot, pages, layout)."""
        key = (slot, pages, adapter.layout)
        found = self.target_views.get(key)
        if found is not None:
            self.target_views.move_to_end(key)
            return found
        found = self.target_views[key] = self._build_targets(slot, pages, adapter)
        if len(self.target_views) > MAX_CACHED_LAYOUTS:
            self.target_views.popitem(last=False)
        return found

    def _build_targets(self, slot: int, pages: tuple[int, ...], adapter: PackedLoraAdapter
                       ) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        dst, scales = [], []
        for (layer, proj), w in adapter.weights.items():
            r = w.a.shape[0]
            if (expert := expert_target(proj)) is not None:
                group, e = expert
                a, b_t, scale = self.layers[layer][group].views(slot, e, r)
                dst += [[a], [b_t]]  # experts keep slots, never pages (engine_startup refuses both)
                scales.append(scale)
                continue
            group, i = PROJECTION_SLICES[proj]
            buffers = self.layers[layer][group]
            a, b = _page_views(buffers, i, pages, r, self.paging.page_rows)
            dst += [a, [v.t() for v in b]]
            scales.append(buffers.scaling[i, slot])
        return dst, scales

    def _load(self, slot: int, pages: tuple[int, ...], adapter: PackedLoraAdapter) -> None:
        # Free pages are already zero (initial state, or cleared by _evict). On CUDA the copies run on a
        # side stream from pinned host memory, overlapping the running batch's compute.
        assert isinstance(adapter, PackedLoraAdapter), "adapters reach slots through the host tier"
        self.loads += 1
        if adapter.vocab is not None:
            assert self.vocab is not None, "an engine that serves vocabulary parts builds its slots with VocabParts"
            self.vocab.load(slot, adapter)
        if self.medusa is not None:
            self.medusa.load(slot, adapter.medusa)
        if self.draft is not None:
            self.draft.load(slot, adapter.draft)
        self.slot_ranks[slot] = adapter.rank
        self.rank_table[slot] = adapter.rank
        self.slot_pages[slot] = pages
        if self.page_table is not None:
            self.page_table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        dst, scales = self._targets(slot, pages, adapter)
        flat_dst = [v for views in dst for v in views]
        self.written[slot] = flat_dst + scales
        src = adapter.tensors()
        if self.copy_stream is None:
            if self.units is not None:  # the pages' units held KV (or another adapter) until lent
                self.units.zero(pages)
            if not src:  # parts of embed_tokens and lm_head only (self.vocab's): nothing for the projections
                return
            torch._foreach_copy_(flat_dst, self._sources(adapter))
            torch._foreach_copy_(scales, adapter.scaling_entries)
            self._load_dora(slot, pages, adapter)
            return
        # The pages were zeroed, and last read (as KV blocks too, when lent), on the compute stream: copy only
        # after that.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.copy_stream.device))
        with torch.cuda.stream(self.copy_stream):
            if self.units is not None:
                self.units.zero(pages)
            if not src:
                return
            for first, last in adapter.spans(self.staging.numel()):
                lo, hi = adapter.extent(first, last)
                part = slice(2 * first, 2 * last)
                targets = [v for views in dst[part] for v in views]
                if hi - lo > self.staging.numel():  # one module larger than the staging buffer
                    for d, s_ in zip(targets, self._by_page(src[part])):
                        d.copy_(s_, non_blocking=True)
                    continue
                stage = self.staging[: hi - lo]
                stage.copy_(adapter.flat[lo:hi], non_blocking=True)  # one copy for the whole range
                staged = [stage[o - lo: o - lo + s_.numel()].view(s_.shape)
                          for o, s_ in zip(adapter.offsets[part], src[part])]
                torch._foreach_copy_(targets, self._by_page(staged))
            n = len(scales)
            self.scaling_staging[:n].copy_(adapter.scalings, non_blocking=True)
            torch._foreach_copy_(scales, list(self.scaling_staging[:n].unbind()))
            self._load_dora(slot, pages, adapter)  # on the copy stream, after the slot's A and B

    def _sources(self, adapter: PackedLoraAdapter) -> list[torch.Tensor]:
        """adapter.tensors() cut into pages, as the load's targets are (kept per adapter: a swap stays a few
        batched ops, tests/server/engine/lora/test_slot_swap_cost.py)."""
        found = self.split_sources.get(adapter)
        if found is None:
            found = self.split_sources[adapter] = self._by_page(adapter.tensors())
        return found

    def _by_page(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each rank-major tensor [r, ...] cut into pages of page rows, in order (views); as they are when
        not paged (one page: the slot)."""
        if not self.paging.paged:
            return tensors
        return [part for t in tensors for part in t.split(self.paging.page_rows)]

    def prepare(self, adapter: PackedLoraAdapter, version: str | None = None) -> PackedLoraAdapter:
        """The host tier's hook on a CPU engine (its loader threads): a DoRA adapter's scales, in place of its
        magnitudes, read from the store for `version` (None: not a stored version), else computed now from
        its packed A and B (the values its slot will hold) and stored."""
        if adapter.vocab is not None and self.vocab is None:  # a failed load, as a DoRA one below
            raise ValueError("adapters with parts of embed_tokens or lm_head are not served by this engine "
                             "(--tensor-parallel-size > 1 does not shard them yet)")
        if not adapter.use_dora or adapter.magnitudes_are_scales:
            return adapter
        if self.dora is None:  # a failed load: its requests get this line, the engine keeps serving
            raise ValueError("DoRA adapters are not served by this engine: its slots have no DoRA scales")
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

    def _load_dora(self, slot: int, pages: tuple[int, ...], adapter: PackedLoraAdapter) -> None:
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
                a, b = _page_views(buffers, i, pages, r, self.paging.page_rows)
                self.dora.compute(layer, group, lo, torch.cat(a), torch.cat(b, dim=1), w.scaling,
                                  magnitudes[at: at + n], dst)
            at += n


def _page_views(buffers: LoraGroupBuffers, i: int, pages: tuple[int, ...], rank: int, page_rows: int
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Slice i's rows of an adapter of `rank` in its pages: A views [rows, in] and B views [n_i, rows], page
    by page (one view of rank rows when not paged: the slot)."""
    a, b = [], []
    for j, page in enumerate(pages[: -(-rank // page_rows)]):
        rows = min(page_rows, rank - j * page_rows)
        a.append(buffers.a[i, page, :rows])
        b.append(buffers.b[i][page, :, :rows])
    return a, b


def adapter_from(adapter: LoraAdapter, prompt: Sequence[int]) -> int:
    """The activation point of `prompt` under `adapter`: 0 unless it is an aLoRA."""
    invocation = invocation_tokens(adapter.config)
    return 0 if invocation is None else activation_start(invocation, prompt)


def token_slots(slot: int, start: int, n: int, first_active: int) -> list[int]:
    """The adapter slot of each of a sequence's tokens at positions start .. start+n-1 when its adapter
    (in `slot`, -1: none) applies from position `first_active` on; -1 before it."""
    if slot < 0 or first_active <= start:
        return [slot] * n
    base = min(n, first_active - start)
    return [-1] * base + [slot] * (n - base)


def base_blocks(first_active: int, block_size: int) -> int:
    """How many leading full blocks hold only tokens before the activation point: the base model's KV."""
    return first_active // block_size
