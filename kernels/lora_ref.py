"""Plain-torch multi-LoRA shrink/expand: the semantics the Triton kernels implement.

Slot buffers hold every loaded adapter at the maximum rank; rows beyond an
adapter's own rank are zero (the slot is zero-filled before reuse), so only
the first `batch.rank_bound` rank columns carry anything and the rest are
skipped. With few adapters in the batch, tokens are grouped by slot and each
group is one matmul across all slices. With many, the groups are cut into
chunks of one width, each chunk's adapter weights are gathered, and all chunks
go through one batched matmul per projection slice: per-adapter Python loops
dominated CPU steps with dozens of adapters.
"""
from __future__ import annotations

import torch

from kernels.metadata import LoraBatch

BATCHED_MIN_SLOTS = 4  # from this many adapters in a batch on, one padded bmm beats a loop per adapter


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
    """
    if not batch.any_lora:
        return
    r = batch.effective_rank(lora_a.shape[2])
    groups = _groups(batch)
    if groups is not None:
        slots, rows, picks, flat = groups  # [G], [G, M], [n] into G*M, [n] token rows
        a = lora_a[:, :, :r].index_select(1, slots).float()  # [S, G, r, in]
        xs = x.float()[rows]  # [G, M, in]
        h = torch.matmul(xs.unsqueeze(0), a.transpose(-1, -2))  # [S, G, M, r]
        h = h * scaling.index_select(1, slots)[:, :, None, None]
        out[:, :, :r].index_copy_(1, flat, h.flatten(1, 2).index_select(1, picks).to(out.dtype))
        return
    for s in batch.active_slots:
        rows = (batch.token_slots == s).nonzero().squeeze(1)  # [n]
        xs = x.index_select(0, rows).float()  # [n, in]
        h = torch.matmul(xs, lora_a[:, s, :r].float().transpose(1, 2))  # [S, n, r]
        h = h * scaling[:, s, None, None]
        out[:, :, :r].index_copy_(1, rows, h.to(out.dtype))


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
    Rows with slot -1 are left bit-identical.
    Shape: h [S, T, R]; lora_b: S tensors [L, n_i, R]; y [T, sum n_i] (or wider),
        modified in place; slice_offsets: S column offsets into y.
    """
    assert len(lora_b) == h.shape[0] == len(slice_offsets)
    if not batch.any_lora:
        return
    r = batch.effective_rank(h.shape[2])
    groups = _groups(batch)
    if groups is not None:
        slots, rows, picks, flat = groups
        for i, (b, off) in enumerate(zip(lora_b, slice_offsets)):
            bs = b[:, :, :r].index_select(0, slots).float()  # [G, n_i, r]
            hs = h[i, :, :r].float()[rows]  # [G, M, r]
            delta = torch.matmul(hs, bs.transpose(1, 2)).flatten(0, 1).index_select(0, picks)  # [n, n_i]
            _add_rows(y, off, b.shape[1], flat, delta)
        return
    for s in batch.active_slots:
        rows = (batch.token_slots == s).nonzero().squeeze(1)  # [n]
        for i, (b, off) in enumerate(zip(lora_b, slice_offsets)):
            delta = h[i, :, :r].index_select(0, rows).float() @ b[s, :, :r].float().t()  # [n, n_i]
            _add_rows(y, off, b.shape[1], rows, delta)


def _groups(batch: LoraBatch):
    """Tokens grouped by adapter in chunks of equal width: (slots [C], rows [C, M], picks [n], flat [n]).

    Each adapter's tokens are cut into chunks of at most M = ceil(n / G) rows (n adapter tokens,
    G adapters), and every chunk is one matrix of the batched matmul, its adapter's weights gathered
    for it. Padding each adapter to the longest group instead made a step that mixes one 128-token
    prefill with 31 decode tokens compute 32 x 128 rows; chunks bound the padded rows by 2n + G
    whatever the mix. `picks` indexes the real (unpadded) entries of a flattened [C*M] tensor;
    `flat` are their token rows.

    None when the batch has too few adapters for batching to pay. Built once per step.
    """
    if len(batch.active_slots) < BATCHED_MIN_SLOTS:
        return None
    if "groups" not in batch.scratch:
        token_slots = batch.token_slots.long()
        device = token_slots.device
        lora_rows = (token_slots >= 0).nonzero().squeeze(1)  # [n]
        order = lora_rows[torch.sort(token_slots[lora_rows], stable=True).indices]  # [n] token rows by slot
        sorted_slots = token_slots[order]  # [n]
        slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)  # [G], [G]
        width = -(-order.numel() // slots.numel())  # M
        chunks = (counts + width - 1) // width  # [G] chunks per adapter
        first_chunk = torch.cumsum(chunks, 0) - chunks  # [G]
        group_start = torch.cumsum(counts, 0) - counts  # [G]
        group = torch.repeat_interleave(torch.arange(slots.numel(), device=device), counts)  # [n]
        pos = torch.arange(order.numel(), device=device) - group_start[group]  # [n] place in its group
        picks = (first_chunk[group] + pos // width) * width + pos % width  # [n] into C*M
        rows = torch.zeros(int(chunks.sum()) * width, dtype=torch.long, device=device)  # padded with row 0
        rows[picks] = order
        batch.scratch["groups"] = (torch.repeat_interleave(slots, chunks), rows.view(-1, width), picks, order)
    return batch.scratch["groups"]


def _add_rows(y: torch.Tensor, off: int, n: int, rows: torch.Tensor, delta: torch.Tensor) -> None:
    """y[rows, off:off+n] += delta, computed in float32 and rounded once to y's dtype."""
    if y.dtype == torch.float32:
        y[:, off : off + n].index_add_(0, rows, delta)  # rows are distinct: the same single rounding
        return
    cur = y[:, off : off + n].index_select(0, rows).float()
    y[:, off : off + n].index_copy_(0, rows, (cur + delta).to(y.dtype))
