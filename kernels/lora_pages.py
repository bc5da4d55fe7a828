"""Adapter weights read through a page table: each slot's rank rows live in pages of a shared pool.

An adapter of rank r occupies ceil(r / page_rows) pages of every module (server.engine.lora.slots), not a
slot of max_lora_rank rows, so a device holds adapters by their rank (S-LoRA's paged adapter memory; the
kernels' indirection is Punica's BGMV / S-LoRA's MBGMV with a page table). The buffers keep the slot
layout's shapes with pages in place of slots and page rows in place of the rank:

- A: [S, P, page_rows, in], stored page-major ([P, S, page_rows, in]): a page's slices are one matrix;
- B: S x [P, n_i, page_rows], stored rank-major ([P, page_rows, n_i]);
- page_table: [L, pages per slot] int32; slot s's rank row r is row r % page_rows of page
  page_table[s, r // page_rows]. Entries past an adapter's own pages name the zero page (never written),
  so a slot reads zeros there, never another adapter's rows.

Scalings, DoRA scales and ranks stay per slot (adapter entry): they index by slot, not page.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.metadata import LoraBatch


def dense_a(lora_a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """Every slot's A as the unpaged layout has it: the reference's view of the indirection.

    Semantics: out[i, s, r] = lora_a[i, page_table[s, r // p], r % p] (p = page rows); lora_a itself when
        the batch is not paged.
    Shape: lora_a [S, P, p, in] -> [S, L, pages * p, in].
    """
    table = batch.page_table
    if table is None:
        return lora_a
    num_slices, _, rows, hidden = lora_a.shape
    slots, pages = table.shape
    return lora_a[:, table.long()].reshape(num_slices, slots, pages * rows, hidden)


def dense_b(lora_b: tuple[torch.Tensor, ...], batch: LoraBatch) -> tuple[torch.Tensor, ...]:
    """Every slot's B per slice as the unpaged layout has it.

    Semantics: out_i[s, :, r] = lora_b[i][page_table[s, r // p], :, r % p]; lora_b itself when not paged.
    Shape: S x [P, n_i, p] -> S x [L, n_i, pages * p].
    """
    table = batch.page_table
    if table is None:
        return lora_b
    slots, pages = table.shape
    return tuple(b[table.long()].permute(0, 2, 1, 3).reshape(slots, b.shape[1], pages * b.shape[2]) for b in lora_b)


@dataclass(frozen=True)
class SlotWeights:
    """One fused projection's A and B^T for chosen slots, at `rank` rows: in place (views) when the buffers
    are slots, gathered through the page table when they are pages (kernels.lora_cpu's operands)."""

    lora_a: torch.Tensor  # [S, L or P, rows, in]
    lora_b: tuple[torch.Tensor, ...]  # S x [L or P, n_i, rows]
    table: torch.Tensor | None  # [L, pages per slot] int32, or None: not paged
    rank: int  # rank rows used per slot (the step's effective rank)
    # Gather buffers by shape, reused by every layer of a step (LoraBatch.scratch): a fresh megabyte per
    # gather cost more in page faults than the copy itself.
    scratch: dict | None = None
    # Gathers kept from earlier steps while still exact (LoraBatch.page_gathers), by source and index.
    kept: dict | None = None

    def _gather(self, src: torch.Tensor, index: torch.Tensor, operand: str) -> torch.Tensor:
        """src.index_select(0, index): a kept one when there is one, else into the step's buffer for `operand`
        (one per operand in use at once) and shape when there is a scratch."""
        if self.kept is not None:
            key = (src.data_ptr(), src.shape, src.stride(), index.numpy().tobytes())
            found = self.kept.get(key)
            if found is None:
                found = self.kept[key] = src.index_select(0, index)
            return found
        if self.scratch is None:
            return src.index_select(0, index)
        shape = (index.shape[0], *src.shape[1:])
        key = ("lora-page-gather", operand, src.dtype, shape)
        out = self.scratch.get(key)
        if out is None:
            out = self.scratch[key] = src.new_empty(shape)
        return torch.index_select(src, 0, index, out=out)

    @property
    def paged(self) -> bool:
        return self.table is not None

    def _pages(self, slots: torch.Tensor) -> torch.Tensor:
        """[G * n] int64: the first n = ceil(rank / page rows) pages of each slot, slot by slot."""
        return self.table.index_select(0, slots)[:, : self._num_pages].reshape(-1).long()

    @property
    def _num_pages(self) -> int:
        return -(-self.rank // self.lora_a.shape[2])

    def a_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """[G, K, in]: every slice's rank rows of each slot [G] int64, in the order split_slices undoes (a
        copy: one gather). Paged, page by page (K = pages x S x page rows), as the pool stores them: no
        reordering of the weights, only of the small products."""
        if not self.paged:
            return self.a(slots).reshape(slots.shape[0], -1, self.lora_a.shape[3])
        picked = self._gather(self.lora_a.transpose(0, 1), self._pages(slots), "a")  # [G * n, S, rows, in]
        return picked.view(slots.shape[0], -1, picked.shape[3])

    def a_rows_span(self, lo: int, hi: int) -> torch.Tensor:
        """a_rows of slots lo..hi-1 (not paged only): a view when the rank is the buffers'."""
        return self.a_span(lo, hi).reshape(hi - lo, -1, self.lora_a.shape[3])

    def split_slices(self, h: torch.Tensor) -> torch.Tensor:
        """[..., K] products with a_rows -> [..., S, rank]."""
        num_slices, lead = self.lora_a.shape[0], h.shape[:-1]
        if not self.paged:
            return h.view(*lead, num_slices, self.rank)
        by_page = h.view(*lead, self._num_pages, num_slices, self.lora_a.shape[2]).transpose(-3, -2)
        return by_page.reshape(*lead, num_slices, -1)[..., : self.rank]

    def a(self, slots: torch.Tensor) -> torch.Tensor:
        """[G, S, rank, in] for slots [G] int64 (a copy)."""
        by_page = self.lora_a.transpose(0, 1)  # [L or P, S, rows, in]
        if not self.paged:
            return by_page[:, :, : self.rank].index_select(0, slots)
        g, (num_slices, rows, hidden) = slots.shape[0], by_page.shape[1:]
        picked = by_page.index_select(0, self._pages(slots))  # [G * n, S, rows, in]
        per_slot = picked.view(g, -1, num_slices, rows, hidden).transpose(1, 2)  # [G, S, n, rows, in]
        return per_slot.reshape(g, num_slices, -1, hidden)[:, :, : self.rank]

    def b(self, i: int, slots: torch.Tensor) -> torch.Tensor:
        """[G, rank, n_i]: slice i's B^T for slots [G] int64."""
        rank_major = self.lora_b[i].transpose(1, 2)  # [L or P, rows, n_i]
        if not self.paged:
            return rank_major[:, : self.rank].index_select(0, slots)
        picked = self._gather(rank_major, self._pages(slots), f"b{i}")  # [G * n, rows, n_i]
        return picked.view(slots.shape[0], -1, picked.shape[2])[:, : self.rank]

    def a_span(self, lo: int, hi: int) -> torch.Tensor:
        """[hi - lo, S, rank, in]: slots lo..hi-1, a view (not paged only)."""
        assert not self.paged
        return self.lora_a.transpose(0, 1)[lo:hi, :, : self.rank]

    def b_span(self, i: int, lo: int, hi: int) -> torch.Tensor:
        """[hi - lo, rank, n_i]: a view (not paged only)."""
        assert not self.paged
        return self.lora_b[i].transpose(1, 2)[lo:hi, : self.rank]

    def b_one(self, i: int, slot: int) -> torch.Tensor:
        """[rank, n_i] of one slot: a view when not paged."""
        if not self.paged:
            return self.lora_b[i].transpose(1, 2)[slot, : self.rank]
        return self.b(i, torch.tensor([slot], device=self.table.device))[0]
