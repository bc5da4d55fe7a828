"""Triton multi-LoRA shrink/expand with the semantics of kernels.lora_ref.

Two shapes of the same math; the step's plan (kernels.metadata) says which
tokens each takes, so one call may launch both:

- gathered (BGMV, decode-shaped runs): one program per (token, slice, rank
  tile) for shrink and per (token, column tile) for expand; each token gathers
  its own adapter's weights and reduces with a multiply-and-sum, which needs no
  16-row minimum the way `tl.dot` does.
- segmented (SGMV, longer runs): one program per (tile of a run, ...), one
  launch per tile height; the adapter's weights are loaded once per tile and
  multiplied with `tl.dot`. A padded decode step's tiled plan (kernels.sorted_tiles,
  plan.order set) runs them INDEXED: rows sorted by slot, each tile's rows read
  through the order, in a table of fixed size per bucket (graph replay).

The `lora` entry (lora_apply) may split each shrink's K over programs
(kernels.metadata.shrink_splits): fp32 partials that the expand sums in a
fixed order, for steps whose few tokens (or tiles) otherwise run few programs.

Expand programs index (slice, column tile) along one grid axis, so the narrow
k/v slices of a fused qkv launch no programs for the wide q slice's columns.
Slot buffers are used in place at max rank (rows beyond an adapter's own rank
are zero), so mixed ranks share a launch with no per-batch copy or padding.
Paged buffers (batch.page_table, kernels.lora_pages) are read in place too, each
rank row through the page table (the PAGED variants, one per page size).
Base-model tokens (slot -1) are in no plan: shrink never writes their rows and
expand never reads or writes them. Row offsets are int64: at ~75k tokens the
gate_up expand's token x column products pass 2^31.

Runtime integers that change from step to step (rank, column tile counts) are
not specialised on, so the compiled variants depend on the engine's
configuration only and are all compiled at start-up (server.engine.warmup).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from kernels import metadata
from kernels.lora_tiles import lora_tiles
from kernels.lora_triton_jit import _bgmv_expand_kernel, _bgmv_shrink_kernel, _sgmv_expand_kernel, _sgmv_shrink_kernel
from kernels.metadata import MAX_SHRINK_SPLITS, TILE_ROWS, LoraBatch, LoraLaunchPlan, shrink_splits

# Expand takes up to this many output slices per launch (fused qkv is 3).
MAX_FUSED_SLICES = 3


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _upcast(*dtypes: torch.dtype) -> bool:
    """Whether the kernels compute their products on fp32 copies of the operands.

    The interpreter's bf16 `tl.dot` is wrong, fp32 operands must not silently
    drop to tf32 on the GPU, and mixed operand dtypes cannot feed `tl.dot`.
    """
    return _interpreting() or any(d == torch.float32 for d in dtypes) or len(set(dtypes)) > 1


def use_gather(batch: LoraBatch) -> bool:
    """Whether the step's plan is all gathered (decode-shaped): no run is long enough to tile."""
    return not any(batch.plan.num_tiles(h) for h in TILE_ROWS)


def num_slots(batch: LoraBatch, weights: torch.Tensor, axis: int) -> int:
    """Slots the batch can name: the page table's rows when paged, else the buffers' `axis` dimension."""
    return weights.shape[axis] if batch.page_table is None else batch.page_table.shape[0]


def page_args(batch: LoraBatch, rows: int) -> tuple[tuple[torch.Tensor, int], dict]:
    """((table, its row stride), {PAGED, PAGE}) for a launch over buffers of `rows` rank rows per slot or
    page; unpaged, a stand-in table the kernels never read."""
    table = batch.page_table
    if table is None:
        return (batch.token_slots, 0), dict(PAGED=False, PAGE=1)
    return (table, table.stride(0)), dict(PAGED=True, PAGE=rows)


def slot_ranks(batch: LoraBatch, num_slots: int) -> torch.Tensor:
    """[L] int32: each slot's own rank for the gathered kernels; without the engine's table, every slot
    at the buffers' full rank (made once per step)."""
    if batch.slot_rank_table is not None:
        return batch.slot_rank_table
    key = ("full-ranks", num_slots)
    if key not in batch.scratch:
        batch.scratch[key] = torch.full((num_slots,), 1 << 30, dtype=torch.int32, device=batch.token_slots.device)
    return batch.scratch[key]


def _check_shrink(x: torch.Tensor, lora_a: torch.Tensor, batch: LoraBatch, scaling: torch.Tensor,
                  out: torch.Tensor) -> None:
    num_slices, _, rows, hidden = lora_a.shape
    assert x.shape == (batch.num_tokens, hidden), (x.shape, lora_a.shape)
    assert out.shape == (num_slices, batch.num_tokens, batch.slot_width(rows)), out.shape
    assert scaling.shape == (num_slices, num_slots(batch, lora_a, 1)), scaling.shape


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    batch: LoraBatch,
    scaling: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Same contract as kernels.lora_ref.lora_shrink; the step's plan picks the form per run.

    Semantics: out[i, t, r] = scaling[i, slot[t]] * (x[t] @ lora_a[i, slot[t], r]) for adapter tokens.
    Shape: x [T, in]; lora_a [S, L, R, in]; scaling [S, L] float32; out [S, T, R]. Paged: lora_a
        [S, P, p, in] read through batch.page_table (kernels.lora_pages), R = p x the table's width.
    """
    _shrink(x, lora_a, batch, scaling, out, batch.plan_for("mixed"))


def shrink_gathered(x: torch.Tensor, lora_a: torch.Tensor, batch: LoraBatch, scaling: torch.Tensor,
                    out: torch.Tensor) -> None:
    """lora_shrink with every adapter token gathered (same contract and shapes)."""
    _shrink(x, lora_a, batch, scaling, out, batch.plan_for("gathered"))


def shrink_segmented(x: torch.Tensor, lora_a: torch.Tensor, batch: LoraBatch, scaling: torch.Tensor,
                     out: torch.Tensor) -> None:
    """lora_shrink with every run tiled (same contract and shapes)."""
    _shrink(x, lora_a, batch, scaling, out, batch.plan_for("segmented"))


def _indexed(plan: LoraLaunchPlan, rows: int, batch: LoraBatch, weights: torch.Tensor, axis: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A segmented launch's (idx_ptr, ranks_ptr): a padded decode step's tiled plan (INDEXED) reads its
    sorted row order and the slots' own ranks (slot_ranks); otherwise stand-ins the kernels never read."""
    if plan.order is None:
        return plan.tiles[rows], plan.tiles[rows]
    return plan.order, slot_ranks(batch, num_slots(batch, weights, axis))


def _dst(out: torch.Tensor, split: SplitK | None) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """A shrink launch's destination, split count and (slice, row, rank, split) strides."""
    if split is None:
        return out, 1, (*out.stride(), 0)
    p = split.partials
    return p, split.splits, (*p.stride()[1:], p.stride(0))


def _shrink(x, lora_a, batch: LoraBatch, scaling, out, plan: LoraLaunchPlan, split: SplitK | None = None,
            tile_split: SplitK | None = None) -> None:
    """split / tile_split: the gathered / tiled tokens' shrink writes their partials instead of out
    (lora_apply)."""
    _check_shrink(x, lora_a, batch, scaling, out)
    if not batch.any_lora:
        return
    num_slices, _, page_rows, hidden = lora_a.shape
    rank = batch.effective_rank(batch.slot_width(page_rows))
    if rank == 0:
        return  # every active slot's rows are zero: no column to write
    table, paging = page_args(batch, page_rows)
    tiles = lora_tiles(lora_a.dtype)
    block_r = tiles.rank_block(rank)
    r_blocks = triton.cdiv(rank, block_r)
    common = (*x.stride(), *lora_a.stride(), *scaling.stride())
    if plan.num_gather:
        dst, splits, dst_strides = _dst(out, split)
        _bgmv_shrink_kernel[(plan.num_gather, num_slices, splits * r_blocks)](
            x, lora_a, scaling, dst, plan.gather, slot_ranks(batch, num_slots(batch, lora_a, 1)), table[0], hidden,
            rank, table[1], *common, *dst_strides, BLOCK_R=block_r, BLOCK_K=tiles.gather_block(block_r, hidden),
            SPLIT=split is not None, **paging,
        )
    dst, splits, dst_strides = _dst(out, tile_split)
    for rows in TILE_ROWS:
        if plan.num_tiles(rows):
            _sgmv_shrink_kernel[(plan.num_tiles(rows), num_slices, splits * r_blocks)](
                x, lora_a, scaling, dst, plan.tiles[rows], *_indexed(plan, rows, batch, lora_a, 1), table[0], hidden,
                rank, table[1], *common, *dst_strides, BLOCK_M=rows, BLOCK_R=block_r, BLOCK_K=tiles.shrink_k,
                UPCAST=_upcast(x.dtype, lora_a.dtype), SPLIT=tile_split is not None, INDEXED=plan.order is not None,
                **paging,
            )


@dataclass(frozen=True)
class SplitK:
    """A shrink form's split: `splits` fp32 partials per row that the expand sums."""

    splits: int
    partials: torch.Tensor  # [splits, S, rows rounded up to 16, R] float32: by plan entry, or by token (tiles)


def split_k(batch: LoraBatch, lora_a: torch.Tensor, splits: int | None = None,
            form: str = "gathered") -> SplitK | None:
    """The split of this projection's gathered tokens (`form` "gathered", partials by plan entry) or
    tiled runs ("tiled", partials by token), or None (unsplit: h in its own dtype).

    splits: None = the launch plan's choice from the shape and the form's programs
    (kernels.metadata.shrink_splits); 1 = unsplit. The partials come from the batch's scratch,
    one buffer per shape made on first use: a padded decode context reuses its buffers on every
    step, so a captured graph writes and reads them where it did at capture.
    """
    num_slices, _, page_rows, hidden = lora_a.shape
    rank = batch.slot_width(page_rows)
    plan = batch.plan
    if form == "gathered":
        rows, programs = plan.num_gather, plan.num_gather
    else:
        assert form == "tiled", form
        if splits is None and not metadata.SPLIT_TILES:
            return None
        rows, programs = batch.num_tokens, sum(plan.num_tiles(h) for h in TILE_ROWS)
    eff = batch.effective_rank(rank)
    if not programs or not eff:
        return None
    if splits is None:
        rank_tiles = triton.cdiv(eff, lora_tiles(lora_a.dtype).rank_block(eff))
        splits = shrink_splits(hidden, programs * num_slices * rank_tiles)
    if splits == 1:
        return None
    assert 1 < splits <= MAX_SHRINK_SPLITS, splits
    # Rows rounded up to 16: every stride is a multiple of 16 elements, so the compiled variant never
    # depends on the step's row count.
    shape = (splits, num_slices, -(-rows // 16) * 16, rank)
    key = ("lora-split-partials", form, shape)
    if key not in batch.scratch:
        batch.scratch[key] = torch.empty(shape, dtype=torch.float32, device=lora_a.device)
    return SplitK(splits, batch.scratch[key])


def lora_apply(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    scaling: torch.Tensor,
    slice_offsets: tuple[int, ...],
    batch: LoraBatch,
    h: torch.Tensor,
    y: torch.Tensor,
    splits: int | None = None,
) -> None:
    """The Triton LoRA strategy's apply (server.engine.lora.backends): a projection's shrink then expand,
    every slice, in one launch of each per form in the step's plan.

    Semantics: for t with s = slot[t] >= 0, y[t, off_i : off_i + n_i] += hs @ lora_b[i][s].T, hs =
        scaling[i, s] * (x[t] @ lora_a[i, s].T), summed in fp32, y rounded once. Unsplit, each form
        stores hs in h (rounded to h's dtype) and reads it back, as lora_shrink then lora_expand do.
        Split (kernels.metadata.shrink_splits, per form: gathered tokens, tiled runs): the shrink
        writes hs as `splits` fp32 partials over slices of the in features, which the expand sums in
        split order, so the result is the same bit for bit on every run (the gathered expand takes the
        sum unrounded, the tiled one in b's dtype for tensor cores); h is not written. Rows with slot -1
        are left bit-identical.
    Shape: x [T, in]; lora_a [S, L, R, in]; lora_b: S tensors [L, n_i, R]; scaling [S, L] float32;
        slice_offsets: S column offsets into y; h [S, T, R] scratch; y [T, >= max(off_i + n_i)].
        splits: None = the plan's choice; 1 = unsplit; 2, 4, 8 forced (tests, benchmarks/kernels/bench_kernels.py).
    """
    if not batch.any_lora:
        return
    split, tile_split = (split_k(batch, lora_a, splits, form) for form in ("gathered", "tiled"))
    _shrink(x, lora_a, batch, scaling, h, batch.plan, split, tile_split)
    _expand(h, lora_b, batch, y, slice_offsets, batch.plan, split, tile_split)


def lora_expand(
    h: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    batch: LoraBatch,
    y: torch.Tensor,
    slice_offsets: tuple[int, ...],
) -> None:
    """Same contract as kernels.lora_ref.lora_expand; the step's plan picks the form per run.

    Semantics: y[t, off_i : off_i + n_i] += h[i, t] @ lora_b[i][slot[t]].T for adapter tokens.
    Up to MAX_FUSED_SLICES slices go in one launch (fused qkv, gate_up).
    Shape: h [S, T, R]; lora_b: S tensors [L, n_i, R]; y [T, >= max(off_i + n_i)].
    """
    _expand(h, lora_b, batch, y, slice_offsets, batch.plan_for("mixed"))


def expand_gathered(h: torch.Tensor, lora_b: tuple[torch.Tensor, ...], batch: LoraBatch, y: torch.Tensor,
                    slice_offsets: tuple[int, ...]) -> None:
    """lora_expand with every adapter token gathered (same contract and shapes)."""
    _expand(h, lora_b, batch, y, slice_offsets, batch.plan_for("gathered"))


def expand_segmented(h: torch.Tensor, lora_b: tuple[torch.Tensor, ...], batch: LoraBatch, y: torch.Tensor,
                     slice_offsets: tuple[int, ...]) -> None:
    """lora_expand with every run tiled (same contract and shapes)."""
    _expand(h, lora_b, batch, y, slice_offsets, batch.plan_for("segmented"))


def _slice_groups(h: torch.Tensor, lora_b: tuple[torch.Tensor, ...], batch: LoraBatch, y: torch.Tensor,
                  slice_offsets: tuple[int, ...]):
    """Validate, then yield (the launch's slice widths, its first slice, its per-slice tensor and int args)."""
    num_slices, num_tokens, rank = h.shape
    assert len(lora_b) == num_slices == len(slice_offsets), (len(lora_b), h.shape, slice_offsets)
    assert num_tokens == batch.num_tokens and y.shape[0] == num_tokens, (h.shape, y.shape)
    for b, off in zip(lora_b, slice_offsets):
        assert batch.slot_width(b.shape[2]) == rank and b.dtype == lora_b[0].dtype, (b.shape, b.dtype, h.shape)
        assert 0 <= off and off + b.shape[1] <= y.shape[1], (off, b.shape, y.shape)
    if not batch.any_lora:
        return
    for first in range(0, num_slices, MAX_FUSED_SLICES):
        group = list(range(first, min(first + MAX_FUSED_SLICES, num_slices)))
        # Unused kernel slice arguments repeat the last slice; no column tile maps to them.
        padded = group + [group[-1]] * (MAX_FUSED_SLICES - len(group))
        bs = [lora_b[i] for i in padded]
        widths = [lora_b[i].shape[1] for i in group]
        tensors = tuple(bs)
        ints = (*[b.shape[1] for b in bs], *[slice_offsets[i] for i in padded])
        strides = tuple(st for b in bs for st in b.stride())
        yield widths, first, tensors, ints, strides


def _column_tiles(widths: list[int], block_n: int) -> tuple[int, int, int]:
    """(column tiles of slice 0, of slice 1, in all): the kernels map one grid axis onto (slice, tile)."""
    counts = [triton.cdiv(n, block_n) for n in widths] + [0, 0]
    return counts[0], counts[1], sum(counts)


def _src(h_part: torch.Tensor, first: int, split: SplitK | None) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """An expand launch's source from slice `first` on, split count and (slice, row, rank, split) strides."""
    if split is None:
        return h_part, 1, (*h_part.stride(), 0)
    p = split.partials[:, first:]
    return p, split.splits, (*p.stride()[1:], p.stride(0))


def _expand(h, lora_b, batch: LoraBatch, y, slice_offsets, plan: LoraLaunchPlan, split: SplitK | None = None,
            tile_split: SplitK | None = None) -> None:
    """split / tile_split: the gathered / tiled tokens' expand sums their partials instead of reading h
    (lora_apply)."""
    rank = batch.effective_rank(h.shape[2])
    tiles = lora_tiles(lora_b[0].dtype)
    block_r = tiles.rank_block(rank)
    upcast = _upcast(h.dtype, lora_b[0].dtype)
    groups = list(_slice_groups(h, lora_b, batch, y, slice_offsets))  # validates even when there is no work
    if rank == 0:
        return  # every active slot's rows are zero: nothing to add
    table, paging = page_args(batch, lora_b[0].shape[2])
    ranks = slot_ranks(batch, num_slots(batch, lora_b[0], 0))
    for widths, first, tensors, ints, strides in groups:
        h_part = h[first:]
        if plan.num_gather:
            src, splits, src_strides = _src(h_part, first, split)
            block_n = tiles.gather_block(block_r, max(widths))
            nb0, nb1, total = _column_tiles(widths, block_n)
            _bgmv_expand_kernel[(plan.num_gather, total)](
                src, y, *tensors, plan.gather, ranks, table[0], rank, splits, table[1], *ints, nb0, nb1,
                *strides, *src_strides, *y.stride(), BLOCK_N=block_n, BLOCK_R=block_r, SPLIT=split is not None,
                **paging,
            )
        src, splits, src_strides = _src(h_part, first, tile_split)
        nb0, nb1, total = _column_tiles(widths, tiles.expand_n)
        for rows in TILE_ROWS:
            if plan.num_tiles(rows):
                _sgmv_expand_kernel[(plan.num_tiles(rows), total)](
                    src, y, *tensors, plan.tiles[rows], *_indexed(plan, rows, batch, lora_b[0], 0), table[0], rank,
                    splits, table[1], *ints, nb0, nb1, *strides, *src_strides, *y.stride(), BLOCK_M=rows,
                    BLOCK_N=tiles.expand_n, BLOCK_R=block_r, UPCAST=upcast, SPLIT=tile_split is not None,
                    INDEXED=plan.order is not None, **paging,
                )
