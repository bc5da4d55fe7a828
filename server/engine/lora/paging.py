"""How the device's adapter memory is laid out: slots of max_lora_rank rows, or pages of rank rows.

With `--lora-page-rows p` an adapter of rank r holds ceil(r / p) pages of every targeted projection's A
and B (kernels.lora_pages), not a slot of `max_lora_rank` rows: with `--max-lora-rank 128`, a rank-8
adapter takes 1/16 of what a slot takes. The pool has the bytes the slots would have had
(`max_loras` x max_lora_rank rows, whether max_loras was given or sized from memory,
server.engine.lora.slot_budget), plus one zero page that every page-table entry past an adapter's own
pages names. Adapter entries (a row of the scaling, rank and page tables each) are counted
apart: as many as half the pool's pages, at least max_loras, so mixed ranks are not capped by entries
before pages. Only the first max_loras entries have a row of DoRA scales (a float32 per output column of
every projection: 5.5 MB per entry for Llama-3-8B, where a rank-8 page is 42 MB), so as many DoRA
adapters are resident as slots held, and a pool of max-rank adapters costs what the slots did.
"""
from __future__ import annotations

from dataclasses import dataclass

# Adapter entries at most, whatever the pool: each is a row of every per-step slot table.
MAX_ENTRIES = 4096


@dataclass(frozen=True)
class LoraPaging:
    page_rows: int  # rank rows per page (max_lora_rank when not paged: a page is a slot)
    pages: int  # pages in the pool, the zero page included when paged
    entries: int  # adapters that can be resident at once
    pages_per_entry: int  # width of the page table: max_lora_rank / page_rows
    paged: bool
    dora_entries: int  # entries 0 .. dora_entries - 1 have a DoRA scale row (DoRA adapters go there)

    @classmethod
    def slots(cls, max_loras: int, max_rank: int) -> LoraPaging:
        """Today's layout: one max-rank slot per adapter."""
        return cls(page_rows=max_rank, pages=max_loras, entries=max_loras, pages_per_entry=1, paged=False,
                   dora_entries=max_loras)

    @classmethod
    def of(cls, max_loras: int, max_rank: int, page_rows: int | None) -> LoraPaging:
        """The layout for `max_loras` slots' worth of memory; page_rows None or max_rank: slots."""
        if page_rows is None or page_rows >= max_rank:
            return cls.slots(max_loras, max_rank)
        check_page_rows(page_rows, max_rank)
        per_entry = max_rank // page_rows
        data_pages = max_loras * per_entry
        entries = min(MAX_ENTRIES, max(max_loras, data_pages // 2))
        return cls(page_rows=page_rows, pages=data_pages + 1, entries=entries, pages_per_entry=per_entry, paged=True,
                   dora_entries=max_loras)

    def pages_for(self, rank: int) -> int:
        """Pages an adapter whose widest module has `rank` rows holds."""
        return 1 if not self.paged else -(-rank // self.page_rows)


def check_page_rows(page_rows: int, max_rank: int) -> None:
    """ValueError naming lora_page_rows unless it is a power of two that divides max_lora_rank."""
    if page_rows < 1 or page_rows & (page_rows - 1) or max_rank % page_rows:
        raise ValueError(f"lora_page_rows must be a power of two dividing max_lora_rank ({max_rank}), "
                         f"got {page_rows}")
