"""One memory pool for KV blocks and adapter pages (`--unified-memory`, S-LoRA's unified paging).

The pool's unit is one KV block's bytes (every layer's K and V); an adapter page (kernels.lora_pages: a
page of rank rows of every projection of every layer) is sized up to a whole number of units. The pool
has as many units as the two budgets together: the KV pool's blocks plus `--max-loras` slots' worth of
pages (on CUDA without --kv-cache-blocks: what the device has left, the adapter share out of it); those
budgets are only its initial shares, and either side may then take any free unit.

One allocator hands out units: the BlockManager's. A page an adapter loads borrows an aligned group of
`units_per_page` blocks nobody holds (PageUnits, the adapter slots' hook; BlockManager.lend: a group
without cached blocks first, from the top of the pool, while the KV packs at the bottom); eviction gives
them back. So whoever needs memory takes, in this order:

1. free units;
2. cached prefix blocks nobody holds (for a sequence least recently released first: the block manager's
   own order; for a page, the group with the fewest);
3. idle adapters' pages (unpinned, no running request), by idle time per unit of reload cost (LoraSlots'
   eviction order);
4. preemption, by the existing rule (the newest running sequence first). A sequence growing its KV
   preempts as before; a request whose adapter must be loaded preempts only sequences that arrived after
   it, so an older request is never preempted for a newer one's adapter.

An adapter in use by a running request is never evicted, nor is a pinned one.

The storage is one allocation too (server.engine.unified_buffer): one byte buffer of `units` units, each
layer's K and V a strided view of it with block b at unit b, and the adapter pages a view with page p at
units (p - 1) * units_per_page .. p * units_per_page - 1 (page 0, the zero page, sits before unit 0 and
is never lent). So a page is lent as an aligned group of whole units (BlockManager.lend), and the bytes a
page holds are the bytes those KV blocks would have held; a lent page is zeroed before an adapter is copied
in, so it never shows the KV (or the adapter) that held it before. `--unified-memory` is refused with
tensor parallelism and with a draft model (whose KV pool is a second pool at the target's block ids).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.block_manager import BlockManager


@dataclass(frozen=True)
class UnifiedPool:
    """The pool's size and units, fixed at start."""

    units: int  # KV blocks' worth of memory in the pool
    unit_bytes: int  # one KV block, every layer
    units_per_page: int  # units one adapter page takes (its bytes rounded up to whole units)
    kv_share: int  # units of the KV budget (--kv-cache-blocks, --cpu-kv-cache-bytes or the default)
    adapter_share: int  # units of the adapter budget (--max-loras slots' worth of pages)

    @classmethod
    def of(cls, kv_blocks: int, unit_bytes: int, page_bytes: int, budget_pages: int) -> UnifiedPool:
        """kv_blocks: the KV budget in blocks; page_bytes: one page's; budget_pages: the adapter budget's pages."""
        per_page = max(1, -(-page_bytes // unit_bytes))
        adapter_share = budget_pages * per_page
        return cls(kv_blocks + adapter_share, unit_bytes, per_page, kv_blocks, adapter_share)

    @classmethod
    def within(cls, units: int, unit_bytes: int, page_bytes: int, budget_pages: int) -> UnifiedPool | None:
        """A pool within `units` measured units (CUDA: what the device has left): the zero page's units and
        the adapter budget's pages out of them; None when they do not leave the KV share a unit."""
        per_page = max(1, -(-page_bytes // unit_bytes))
        adapter_share = budget_pages * per_page
        units -= per_page  # the zero page (server.engine.unified_buffer): in the buffer, never lent
        if units <= adapter_share:
            return None
        return cls(units, unit_bytes, per_page, units - adapter_share, adapter_share)

    @property
    def pages(self) -> int:
        """Adapter pages the pool could hold if adapters took all of it (the zero page aside)."""
        return self.units // self.units_per_page

    @property
    def page_bytes(self) -> int:
        """The bytes between two pages: units_per_page units."""
        return self.units_per_page * self.unit_bytes


class PageUnits:
    """LoraSlots' view of the pool: the units behind each resident adapter's pages, borrowed from the
    block manager at load and given back at eviction."""

    def __init__(self, pool: UnifiedPool, blocks: BlockManager, page_bytes: torch.Tensor) -> None:
        """page_bytes: [pages, pool.page_bytes] uint8, each page's bytes (UnifiedBuffer.page_bytes)."""
        self.pool = pool
        self.blocks = blocks
        self.page_bytes = page_bytes
        self.held: dict[int, list[int]] = {}  # adapter slot (entry) -> the blocks its pages took

    def room(self, taking: frozenset[int] = frozenset()) -> int:
        """Pages the pool can give now without evicting an adapter or preempting: aligned groups of units
        nobody holds (free or cached blocks, none of `taking`: cached blocks a sequence is about to take)."""
        return self.blocks.lendable(self.pool.units_per_page, taking)

    def units_for(self, pages: int) -> int:
        return pages * self.pool.units_per_page

    def take(self, slot: int, pages: int) -> tuple[int, ...]:
        """`pages` pages for `slot`: the page ids whose units the block manager lent (page g + 1 is group g)."""
        per = self.pool.units_per_page
        groups = [self.blocks.lend(per) for _ in range(pages)]
        self.held[slot] = [b for g in groups for b in range(g * per, g * per + per)]
        return tuple(g + 1 for g in groups)

    def zero(self, pages: tuple[int, ...]) -> None:
        """Zero the lent pages' bytes, every module's rows and what no module of the adapter writes: the KV
        blocks, or the adapter, they held before never show (nor read as fp8 NaN)."""
        index = torch.tensor(pages, dtype=torch.long).to(self.page_bytes.device, non_blocking=True)
        self.page_bytes.index_fill_(0, index, 0)

    def give(self, slot: int) -> None:
        self.blocks.repay(self.held.pop(slot))


def unified_refusal(tensor_parallel_size: int, draft_model: bool, kv_groups: bool) -> str | None:
    """One line naming what --unified-memory does not combine with (None: it runs)."""
    if tensor_parallel_size > 1:
        return f"--unified-memory does not combine with --tensor-parallel-size {tensor_parallel_size} yet"
    if draft_model:
        return "--unified-memory does not combine with a draft model (its KV pool is a second pool) yet"
    if kv_groups:
        return ("--unified-memory does not serve a model with KV layer groups (sliding layers interleaved with "
                "global ones: Gemma 2/3, Qwen with max_window_layers) yet: their blocks are one group's layers")
    return None
