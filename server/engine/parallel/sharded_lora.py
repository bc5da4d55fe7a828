"""--fully-sharded-loras: LoRA's A sharded too, as S-LoRA (and vLLM's fully_sharded_loras) do.

Column layers (qkv, gate_up): each rank holds its R / tp rank rows of A and shrinks into them; the
shrink outputs are all_gathered ([S, T, R], small beside activations) and each rank expands with its
output rows of B (as without the flag). Row layers (o, down): A by input as without the flag, but its
partial shrink is all_reduced first ([T, R]) so each rank expands with only its H / tp output rows of B,
into its columns of the partial output, which the base's all_reduce then sums. A rank then reads 1/tp of
every adapter's A and B instead of all of A (column) or all of B (row).

Rank rows past an adapter's own rank are zero in the slot, so shrink's rank bound (the largest active
rank) is exact on every rank's slice; the shrink output starts zeroed, so columns it leaves unwritten
gather as zeros.
"""
from __future__ import annotations

import torch

from server.engine.lora.slots import LoraGroupBuffers
from server.engine.model import LoraLinear, StepContext
from server.engine.parallel.collectives import Collectives
from server.engine.parallel.tp_weights import weight_columns


class ShardedColumnLora:
    """A column-parallel projection (tp_layers.column_parallel) with its A cut to this rank's rank rows."""

    def __init__(self, lin: LoraLinear, rank_span: tuple[int, int], comm: Collectives) -> None:
        self.inner = lin  # its base (float or quantized), B rows and DoRA columns
        self.weight, self.bias, self.lora = lin.weight, lin.bias, lin.lora
        self.a = lin.lora.a[:, :, rank_span[0]:rank_span[1]]  # [S, L, R / tp, in]
        self.comm = comm

    def __call__(self, x: torch.Tensor, ctx: StepContext, out: torch.Tensor) -> torch.Tensor:
        y = self.inner.project(x, ctx, out)
        if ctx.lora.any_lora:
            lora = self.lora
            h = x.new_zeros(self.a.shape[0], x.shape[0], self.a.shape[2])  # [S, T, R / tp]
            ctx.ops.lora.shrink(x, self.a, ctx.lora, lora.scaling, h)
            ctx.ops.lora.expand(self.comm.gather_last(h), lora.b, ctx.lora, y, lora.offsets)  # h: [S, T, R]
        self.inner.rescale(y, ctx)
        return y


class ShardedRowLora:
    """A row-parallel projection over this rank's input columns whose LoRA expands into this rank's
    output columns only; the base all_reduce sums the partial outputs (DoRA-scaled by the full width's
    table before it: the scales are per output column, so they commute with the sum)."""

    def __init__(self, lin: LoraLinear, in_span: tuple[int, int], out_span: tuple[int, int], rank: int,
                 comm: Collectives) -> None:
        lo, hi = in_span
        self.a = lin.lora.a[..., lo:hi]  # [1, L, R, in / tp]
        self.out_span = out_span
        self.b = tuple(b[:, out_span[0]:out_span[1]] for b in lin.lora.b)  # [L, H / tp, R]
        self.lora = LoraGroupBuffers(self.a, self.b, lin.lora.scaling, (0,), lin.lora.dora_scale)
        self.inner = LoraLinear(weight_columns(lin.weight, lo, hi), lin.bias if rank == 0 else None, self.lora,
                                lin.dequant_scratch)
        self.weight, self.bias = self.inner.weight, self.inner.bias
        self.comm = comm

    def __call__(self, x: torch.Tensor, ctx: StepContext, out: torch.Tensor) -> torch.Tensor:
        y = self.inner.project(x, ctx, out)
        if ctx.lora.any_lora:
            h = x.new_zeros(1, x.shape[0], self.a.shape[2])  # [1, T, R]
            ctx.ops.lora.shrink(x, self.a, ctx.lora, self.lora.scaling, h)
            lo, hi = self.out_span
            ctx.ops.lora.expand(self.comm.all_reduce(h), self.b, ctx.lora, y[:, lo:hi], (0,))
        self.inner.rescale(y, ctx)
        return self.comm.all_reduce(y)
