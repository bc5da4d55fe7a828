"""A decoder layer's projections cut for one tensor-parallel rank, with their LoRA slots read as views.

Column-parallel (qkv, gate_up): the rank's output columns (its heads, its intermediate columns) of
every fused slice; LoRA A whole (every rank shrinks the full input), B's rows for those columns.
Row-parallel (o, down): the rank's input columns; LoRA A's input columns, B whole. Shrink and expand
are linear in x, so sum_r (x_r A_r^T) B^T = (x A^T) B^T: each rank's partial delta rides the base
all_reduce and LoRA adds no communication (vLLM's default sharding). The bias of a row layer is added
on rank 0 only, so the sum has it once.

The slot buffers stay whole (the engine's LoraSlots writes adapters into them as without TP) and each
rank reads views of them: no copy per load, and one slot manager whatever the world size.

DoRA: rank 0's slots compute each DoRA adapter's per-output-column scales g = m / ||W + s B A|| against
the full weight (server.engine.lora.dora_scales keeps TP = 1's), so every column's norm is its whole
row's. A column-parallel rank holds whole output columns: it scales them by its columns of the table
(read at each call: LoraLinear.dora_cols). A row-parallel rank's partial output is scaled by the full
width's g: sum_r g (x_r W_r^T + delta_r) = g (x W^T + delta), and the bias comes once, from rank 0.

Quantized bases: the weights TP = 1 quantized, cut (server.engine.parallel.tp_weights).
"""
from __future__ import annotations

import torch

from server.engine.lora.slots import LoraGroupBuffers
from server.engine.model import LoraLinear, StepContext
from server.engine.parallel.collectives import Collectives
from server.engine.parallel.tp_weights import weight_columns, weight_rows


def column_spans(out_sizes: tuple[int, ...], spans: tuple[tuple[int, int], ...]) -> list[int]:
    """The fused output's column indices a rank keeps: span i of slice i (offset by the slices before it)."""
    cols, base = [], 0
    for n, (lo, hi) in zip(out_sizes, spans):
        cols += range(base + lo, base + hi)
        base += n
    return cols


def column_parallel(lin: LoraLinear, spans: tuple[tuple[int, int], ...]) -> LoraLinear:
    """lin (fused slices, each cut to spans[i] of its outputs) for one rank."""
    lora = lin.lora
    out_sizes = tuple(b.shape[1] for b in lora.b)
    cols = torch.tensor(column_spans(out_sizes, spans), device=lora.a.device)
    local = tuple(hi - lo for lo, hi in spans)
    buffers = LoraGroupBuffers(
        a=lora.a,
        b=tuple(b[:, lo:hi] for b, (lo, hi) in zip(lora.b, spans)),  # views: the slots' loads show through
        scaling=lora.scaling,
        offsets=tuple(sum(local[:i]) for i in range(len(local))),
        dora_scale=lora.dora_scale,  # whole: its columns `cols` read at each call
    )
    bias = None if lin.bias is None else lin.bias.index_select(0, cols)
    return LoraLinear(weight_rows(lin.weight, cols), bias, buffers, lin.dequant_scratch, dora_cols=cols)


class RowParallelLinear:
    """A projection over this rank's input columns whose partial outputs (base and LoRA) are summed
    over the ranks by one all_reduce."""

    def __init__(self, lin: LoraLinear, span: tuple[int, int], rank: int, comm: Collectives) -> None:
        lo, hi = span
        lora = lin.lora
        buffers = LoraGroupBuffers(a=lora.a[..., lo:hi], b=lora.b, scaling=lora.scaling, offsets=lora.offsets,
                                   dora_scale=lora.dora_scale)
        self.inner = LoraLinear(weight_columns(lin.weight, lo, hi), lin.bias if rank == 0 else None, buffers,
                                lin.dequant_scratch)
        self.comm = comm

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    @property
    def lora(self) -> LoraGroupBuffers:
        return self.inner.lora

    def __call__(self, x: torch.Tensor, ctx: StepContext, out: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x, ctx, out))
