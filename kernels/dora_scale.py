"""DoRA in a mixed batch: each row's output scaled by its adapter slot's per-column DoRA scale.

The LoRA kernels (Triton, CPU or reference alike) add x A^T B^T scaled onto x W^T; for a DoRA adapter
the module's output is that sum times g = m / ||W + s B A|| per output column, plus the bias
(server.engine.lora.dora_scales). So a step with DoRA rows needs one gathered multiply after the LoRA
kernels, whatever the kernel set, and base, LoRA and DoRA rows share the batch and every launch:
plain-LoRA slots and base rows have scale 1.0, which leaves their values as they were.
"""
from __future__ import annotations

import torch

from kernels.metadata import LoraBatch


def dora_scale(y: torch.Tensor, table: torch.Tensor, batch: LoraBatch, bias: torch.Tensor | None,
               cols: torch.Tensor | None = None) -> None:
    """Scale each row of y by its slot's DoRA scales, then add the bias, in place.

    Semantics: for each row t, with s = batch.token_slots[t] (s = D, the table's last row, for -1 and for
    slots past D: adapter entries without DoRA scales, server.engine.lora.paging):
        y[t, :] = y[t, :] * table[s, :] (product in float32, rounded to y's dtype), then + bias.
    With cols, y holds those columns of the table's only (a tensor-parallel rank's output columns):
        y[t, j] = y[t, j] * table[s, cols[j]].
    Shape: y [T, W] (x W^T plus the LoRA delta, no bias yet); table [D + 1, W] float32 ([D + 1, W'] with
        cols [W] int64), row D all 1.0; bias [W] or None.
    """
    if cols is not None:  # read at every call: the slots write the whole table as adapters load
        table = table.index_select(1, cols)
    y.mul_(table.index_select(0, _table_rows(batch, table.shape[0] - 1)))  # [T, W] gathered scales
    if bias is not None:
        y.add_(bias)


def _table_rows(batch: LoraBatch, base_row: int) -> torch.Tensor:
    """[T] int64: each token's slot, base rows (-1) and slots without a DoRA row sent to the all-ones row.

    Built once per step and shared by every layer; a padded decode batch's token slots are refilled in
    place under the same LoraBatch (and may be replayed as a CUDA graph), so there it is rebuilt per call.
    """
    if batch.padded:
        return _rows(batch.token_slots, base_row)
    if "dora_rows" not in batch.scratch:
        batch.scratch["dora_rows"] = _rows(batch.token_slots, base_row)
    return batch.scratch["dora_rows"]


def _rows(token_slots: torch.Tensor, base_row: int) -> torch.Tensor:
    slots = token_slots.long()
    return torch.where((slots >= 0) & (slots < base_row), slots, torch.full_like(slots, base_row))
