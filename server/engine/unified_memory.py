"""One memory pool for KV blocks and adapter pages (`--unified-memory`, S-LoRA's unified paging).

The pool's unit is one KV block's bytes (every layer's K and V); an adapter page (kernels.lora_pages: a
page of rank rows of every projection of every layer) is sized up to a whole number of units. The pool
has as many units as the two budgets together: the KV pool's blocks plus `--max-loras` slots' worth of
pages; those budgets are only its initial shares, and either side may then take any free unit.

One allocator hands out units: the BlockManager's. A page an adapter loads borrows `units_per_page` of
its blocks (PageUnits, the adapter slots' hook), taken like a sequence's: a free block first, then the
least recently released cached prefix block; eviction gives them back. So whoever needs memory takes,
in this order:

1. free units;
2. cached prefix blocks nobody holds (least recently released first: the block manager's own order);
3. idle adapters' pages (unpinned, no running request), by idle time per unit of reload cost (LoraSlots'
   eviction order);
4. preemption, by the existing rule (the newest running sequence first). A sequence growing its KV
   preempts as before; a request whose adapter must be loaded preempts only sequences that arrived after
   it, so an older request is never preempted for a newer one's adapter.

An adapter in use by a running request is never evicted, nor is a pinned one.

The accounting is shared, the storage is not yet one allocation: the KV tensors have a block for every
unit and the adapter buffers a page for every `units_per_page` units, both mapped by the OS on first touch
(CPU), so what the engine may *use* is the pool, while resident memory can reach the two tensors'
touched parts. Aliasing the two in one allocation (which CUDA needs, where nothing maps lazily) is not
built: `--unified-memory` is refused on CUDA, with tensor parallelism and with a draft model (whose KV
pool is a second pool at the target's block ids).
"""
from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def pages(self) -> int:
        """Adapter pages the pool could hold if adapters took all of it (the zero page aside)."""
        return self.units // self.units_per_page


class PageUnits:
    """LoraSlots' view of the pool: the units behind each resident adapter's pages, borrowed from the
    block manager at load and given back at eviction."""

    def __init__(self, pool: UnifiedPool, blocks: BlockManager) -> None:
        self.pool = pool
        self.blocks = blocks
        self.held: dict[int, list[int]] = {}  # adapter slot (entry) -> the blocks its pages took

    def room(self) -> int:
        """Pages the pool can give now without evicting an adapter or preempting (free and cached blocks)."""
        return self.blocks.num_free_blocks // self.pool.units_per_page

    def units_for(self, pages: int) -> int:
        return pages * self.pool.units_per_page

    def take(self, slot: int, pages: int) -> None:
        self.held[slot] = self.blocks.lend(self.units_for(pages))

    def give(self, slot: int) -> None:
        self.blocks.repay(self.held.pop(slot))


def unified_refusal(device_type: str, tensor_parallel_size: int, draft_model: bool, kv_groups: bool) -> str | None:
    """One line naming what --unified-memory does not combine with (None: it runs)."""
    if device_type != "cpu":
        return (f"--unified-memory runs on CPU devices for now, not {device_type}: the KV blocks and adapter "
                f"pages are not one allocation there yet")
    if tensor_parallel_size > 1:
        return f"--unified-memory does not combine with --tensor-parallel-size {tensor_parallel_size} yet"
    if draft_model:
        return "--unified-memory does not combine with a draft model (its KV pool is a second pool) yet"
    if kv_groups:
        return ("--unified-memory does not serve a model with KV layer groups (sliding layers interleaved with "
                "global ones: Gemma 2/3, Qwen with max_window_layers) yet: their blocks are one group's layers")
    return None
