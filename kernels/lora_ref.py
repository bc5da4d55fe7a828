"""Plain-torch multi-LoRA shrink/expand: the semantics the Triton kernels implement.

Slot buffers hold every loaded adapter at the maximum rank; rows beyond an
adapter's own rank are zero (the slot is zero-filled before reuse), so only
the first `batch.rank_bound` rank columns carry anything and the rest are
skipped. Tokens are grouped by slot: one matmul per adapter present covers
all its tokens and all slices (gathering per-token weights measured 3x
slower on CPU).
"""
from __future__ import annotations

import torch

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
    """
    if not batch.any_lora:
        return
    r = batch.effective_rank(lora_a.shape[2])
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
    for s in batch.active_slots:
        rows = (batch.token_slots == s).nonzero().squeeze(1)  # [n]
        for i, (b, off) in enumerate(zip(lora_b, slice_offsets)):
            delta = h[i, :, :r].index_select(0, rows).float() @ b[s, :, :r].float().t()  # [n, n_i]
            _add_rows(y, off, b.shape[1], rows, delta)


def _add_rows(y: torch.Tensor, off: int, n: int, rows: torch.Tensor, delta: torch.Tensor) -> None:
    """y[rows, off:off+n] += delta, computed in float32 and rounded once to y's dtype."""
    cur = y[:, off : off + n].index_select(0, rows).float()
    y[:, off : off + n].index_copy_(0, rows, (cur + delta).to(y.dtype))
