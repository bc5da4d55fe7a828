"""Plain-torch multi-LoRA shrink/expand: the semantics the Triton kernels implement.

Slot buffers hold every loaded adapter at the maximum rank; rows beyond an
adapter's own rank are zero, so a smaller rank costs nothing in correctness
(the slot is zero-filled before reuse).
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

    Semantics: for t with s = slot[t] >= 0, for each slice i:
        out[i, t, :] = scaling[i, s] * (x[t] @ lora_a[i, s].T)
    Rows with slot -1 are not written.
    Shape: x [T, in]; lora_a [S, L, R, in] (S slices, L slots, R max rank);
        batch.token_slots [T]; scaling [S, L] float32; out [S, T, R], written in place.
    """
    for s in batch.active_slots:
        rows = (batch.token_slots == s).nonzero().squeeze(1)  # [n]
        xs = x.index_select(0, rows).float()  # [n, in]
        for i in range(lora_a.shape[0]):
            h = (xs @ lora_a[i, s].float().t()) * scaling[i, s]  # [n, R]
            out[i].index_copy_(0, rows, h.to(out.dtype))


def lora_expand(
    h: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    batch: LoraBatch,
    y: torch.Tensor,
    slice_offsets: tuple[int, ...],
) -> None:
    """Project back from LoRA space and add onto the base output, per slice.

    Semantics: for t with s = slot[t] >= 0, for each slice i with n_i = lora_b[i].shape[1]:
        y[t, off[i] : off[i] + n_i] += h[i, t] @ lora_b[i][s].T
    Rows with slot -1 are left bit-identical.
    Shape: h [S, T, R]; lora_b: S tensors [L, n_i, R]; y [T, sum n_i] (or wider),
        modified in place; slice_offsets: S column offsets into y.
    """
    assert len(lora_b) == h.shape[0] == len(slice_offsets)
    for s in batch.active_slots:
        rows = (batch.token_slots == s).nonzero().squeeze(1)  # [n]
        for i, (b, off) in enumerate(zip(lora_b, slice_offsets)):
            n = b.shape[1]
            delta = h[i].index_select(0, rows).float() @ b[s].float().t()  # [n, n_i]
            cur = y[:, off : off + n].index_select(0, rows).float()
            y[:, off : off + n].index_copy_(0, rows, (cur + delta).to(y.dtype))
