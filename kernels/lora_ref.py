"""Plain-torch multi-LoRA shrink/expand: the semantics the Triton kernels and kernels.lora_cpu implement.

Written for clarity, one adapter slot at a time; the CPU engine runs kernels.lora_cpu, which fuses
both sides and batches the adapters. Slot buffers hold every loaded adapter at the maximum rank;
rows beyond an adapter's own rank are zero (the slot is zero-filled before reuse), so only the first
`batch.rank_bound` rank columns carry anything. Paged buffers (batch.page_table set) are read as
kernels.lora_pages.dense_a / dense_b see them: each slot's pages, in table order, are its rank rows.
Every Triton plan of a step computes these semantics (kernels.lora_triton): gathered tokens, segmented
tiles, and a padded decode step's tiled plan (kernels.sorted_tiles: rows sorted by slot, read through
the order), whose batch's token_slots and active_slots (every slot that may occur) give the same rows here.
"""
from __future__ import annotations

import torch

from kernels.lora_pages import dense_a, dense_b
from kernels.metadata import LoraBatch


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    batch: LoraBatch,
    scaling: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Project tokens into each slice's LoRA space, scaled.

    Semantics: for t with s = slot[t] >= 0, for each slice i, r < batch.effective_rank(R):
        out[i, t, r] = scaling[i, s] * (x[t] @ lora_a[i, s, r].T)
    Rows with slot -1, and rank columns past the effective rank, are not written.
    Shape: x [T, in]; lora_a [S, L, R, in] (S slices, L slots, R max rank);
        batch.token_slots [T]; scaling [S, L] float32; out [S, T, R], written in place.
        Paged: lora_a [S, P, p, in] (P pages of p rows) and R = p x the page table's width.
    """
    lora_a = dense_a(lora_a, batch)
    r = batch.effective_rank(lora_a.shape[2])
    for s, rows in _slot_rows(batch):
        hs = torch.matmul(x[rows].float(), lora_a[:, s, :r].float().transpose(1, 2))  # [S, n, r]
        out[:, rows, :r] = (hs * scaling[:, s, None, None]).to(out.dtype)


def lora_expand(
    h: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    batch: LoraBatch,
    y: torch.Tensor,
    slice_offsets: tuple[int, ...],
) -> None:
    """Project back from LoRA space and add onto the base output, per slice.

    Semantics: for t with s = slot[t] >= 0, for each slice i with n_i = lora_b[i].shape[1],
    and R' = batch.effective_rank(R):
        y[t, off[i] : off[i] + n_i] += h[i, t, :R'] @ lora_b[i][s, :, :R'].T
    summed in float32 and rounded once to y's dtype. Rows with slot -1 are left bit-identical.
    Shape: h [S, T, R]; lora_b: S tensors [L, n_i, R]; y [T, sum n_i] (or wider),
        modified in place; slice_offsets: S column offsets into y. Paged: lora_b S x [P, n_i, p].
    """
    lora_b = dense_b(lora_b, batch)
    assert len(lora_b) == h.shape[0] == len(slice_offsets)
    r = batch.effective_rank(h.shape[2])
    for s, rows in _slot_rows(batch):
        for i, (b, off) in enumerate(zip(lora_b, slice_offsets)):
            cols = slice(off, off + b.shape[1])
            delta = h[i, rows, :r].float() @ b[s, :, :r].float().t()  # [n, n_i]
            y[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)


def _slot_rows(batch: LoraBatch):
    """(slot, token rows) for each adapter slot in the batch."""
    slots = batch.token_slots.long()
    for s in batch.active_slots:
        yield s, (slots == s).nonzero().squeeze(1)
