"""Multi-LoRA on the CPU: shrink and expand of one fused projection in one pass, a fixed handful of ops
whatever the number of adapters in the batch.

Same result as kernels.lora_ref's shrink then expand; profiled with benchmarks/profile/profile_step.py.
Slot buffers hold every loaded adapter at the maximum rank; rows beyond an adapter's own rank are
zero, so only the first `batch.rank_bound` rank columns are computed. Two forms, chosen per run of
one adapter's consecutive tokens (a step may use both):

- runs of SEGMENT_MIN_RUN tokens or more (prefill chunks): each stretch of adjacent runs is shrunk
  by one grouped matmul (`torch._grouped_mm`, a matmul per run inside one call), and each run's
  expand is added onto the base output's rows in place; gathering and scattering prefill-sized
  deltas cost more than the matmuls.
- shorter runs (decodes): the tokens are grouped in chunks of one adapter each, and one batched
  matmul per side does every chunk (and, for the shrink, every fused slice) at once; the deltas land
  on the base output with one contiguous index_add_. A loop per adapter made the op count, not the
  math, dominate such steps, and so did going through the composed form's [S, T, R] scratch: with
  32 adapters the gathers, copies and scatters around the matmuls took twice the matmuls' time.

A is best stored slot-major ([L, S, R, in] in memory, viewed as [S, L, R, in]; see
server.engine.lora.slots): then one slot's slices are one [S*R, in] matrix, and a span of slots is
read in place by the shrink's single batched matmul. Other layouts give the same result with a copy.

Paged buffers (batch.page_table set: adapter memory by rank, kernels.lora_pages) are read through the
table: each step gathers the pages of the slots it uses (kernels.lora_pages.SlotWeights), one
index_select per operand, in place of the unpaged layout's views.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.lora_pages import SlotWeights
from kernels.metadata import LoraBatch

SEGMENT_MIN_RUN = 32  # adapter tokens in a run from which its own matmul beats gathered chunks


def lora_apply(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    scaling: torch.Tensor,
    slice_offsets: tuple[int, ...],
    batch: LoraBatch,
    h: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """Add each token's LoRA delta onto the base output, every slice of a fused projection.

    Semantics: kernels.lora_ref.lora_shrink(x, lora_a, batch, scaling, h) then
        kernels.lora_ref.lora_expand(h, lora_b, batch, y, slice_offsets): for t with s = slot[t] >= 0,
        y[t, off[i] : off[i] + n_i] += round(scaling[i, s] * (x[t] @ lora_a[i, s].T)) @ lora_b[i][s].T,
        where round is to h's dtype (the composed form's scratch), the sum is in float32 and y is
        rounded once. Rows with slot -1 are left bit-identical; h is not written.
    Shape: x [T, in]; lora_a [S, L, R, in]; lora_b: S tensors [L, n_i, R]; scaling [S, L] float32;
        slice_offsets: S column offsets into y; h [S, T, R] (only its dtype is used); y [T, >= sum n_i].
        Paged (batch.page_table): lora_a [S, P, p, in] and lora_b S x [P, n_i, p], read through the table.
    """
    if not batch.any_lora:
        return
    width = batch.slot_width(lora_a.shape[2])
    if batch.padded:
        _apply_padded(x, SlotWeights(lora_a, lora_b, batch.page_table, width), scaling, slice_offsets, batch,
                      h.dtype, y)
        return
    r = batch.effective_rank(width)
    # A: contiguous per slot when slot-major
    w = SlotWeights(lora_a, lora_b, batch.page_table, r, batch.scratch, batch.page_gathers)
    for blk in _long_blocks(batch):
        _apply_block(x, w, scaling, slice_offsets, blk, r, h.dtype, y)
    g = _groups(batch)
    if g is not None:
        _apply_chunks(x, w, scaling, slice_offsets, g, r, h.dtype, y)


def _apply_padded(x, w: SlotWeights, scaling, slice_offsets, batch: LoraBatch, h_dtype, y) -> None:
    """A padded decode batch: every row gathers its slot's weights, at the slots' full rank, with no
    host value read from the data (no sync: the same ops whatever the step, so a CUDA graph can replay
    them). Rows of slot -1 gather slot 0 and have their share masked off; y keeps them bit-identical.

    x [T, in]; w: every slot at full rank R; y [T, >= sum n_i].
    """
    slots = batch.token_slots.long()  # [T]
    lora_rows = slots >= 0  # [T]
    idx = slots.clamp(min=0)  # [T]
    a = w.a(idx).transpose(0, 1).float()  # [S, T, R, in]
    hs = torch.matmul(a, x.float()[None, :, :, None]).squeeze(-1)  # [S, T, R]
    hs = _rounded(hs * (scaling.index_select(1, idx) * lora_rows)[:, :, None], h_dtype)
    for i, (hi, off) in enumerate(zip(hs, slice_offsets)):
        b = w.b(i, idx).float()  # [T, R, n_i]
        dst = y[:, off : off + b.shape[2]]  # [T, n_i]
        delta = torch.matmul(hi[:, None, :], b).squeeze(1)  # [T, n_i]
        dst.copy_(torch.where(lora_rows[:, None], (dst.float() + delta).to(y.dtype), dst))


def _apply_block(x, w: SlotWeights, scaling, slice_offsets, blk: _Block, r: int, h_dtype, y) -> None:
    """Adjacent long runs: one grouped matmul shrinks them all, then each run's expand lands in place.

    x [T, in]; w: the slots' A and B^T at rank r. The expand stays a matmul per run and slice, accumulated
    into the base output (addmm_): a grouped expand returns a new prefill-sized tensor, and on
    this machine allocating and first touching one ([4037, 3072], 50 MB) cost more than the
    matmul (28 ms against 3.7 ms in place).
    """
    rows = slice(blk.start, blk.start + blk.rows)
    a = w.a_rows(blk.slots).float()  # [G, K, in]: every slice's rank rows
    hs = w.split_slices(_grouped_mm(x[rows].float(), a.transpose(1, 2), blk.offs, blk.ends))  # [n, S, r]
    hs = _rounded(hs * scaling.t().index_select(0, blk.row_slots)[:, :, None], h_dtype)
    spans = [(off, off + b.shape[1]) for b, off in zip(w.lora_b, slice_offsets)]
    for start, n, s in blk.runs:
        y_run, hs_run = y[start : start + n], hs[start - blk.start : start - blk.start + n]  # [n, W], [n, S, r]
        for i, (lo, hi) in enumerate(spans):
            dst = y_run[:, lo:hi]
            b = w.b_one(i, s)  # [r, n_i]
            if y.dtype == torch.float32:
                dst.addmm_(hs_run[:, i], b)  # in place: no delta the size of the output
            else:
                dst.copy_(dst.float().addmm_(hs_run[:, i], b.float()))  # rounded once


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, ends: tuple[int, ...]) -> torch.Tensor:
    """Rows of a up to offs[0] times b[0], then up to offs[1] times b[1], ...: a [n, k], b [G, k, m] -> [n, m];
    ends: offs on the host.

    On a CPU, torch._grouped_mm, which takes operands whose strides and start are multiples of 16 bytes
    (ranks and widths that are multiples of 4 in float32); others (an odd rank), and every CUDA call, take
    a matmul per group over the host ends. On CUDA torch._grouped_mm computes bf16 alone and its fallback
    for float32 reads offs back to the host (offs.cpu()) per call: a sync, which also kept the kernel bench
    from capturing the torch rows of prefill-sized runs in a CUDA graph.
    """
    if a.device.type == "cpu" and all(_aligned(t) for t in (a, b)):
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(ends):
        torch.mm(a[start:end], b[g], out=out[start:end])
        start = end
    return out


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride() if st != 1)


def _apply_chunks(x, w: SlotWeights, scaling, slice_offsets, g: _Groups, r: int, h_dtype, y) -> None:
    """The short runs' tokens, chunk by chunk: x [T, in]; w: the slots' A and B^T at rank r."""
    chunks, width = g.rows.shape
    num_slices = w.lora_a.shape[0]
    lora_b = w.lora_b
    xs = x[g.rows].float()  # [C, M, in]
    span = g.span if not w.paged else None  # pages are gathered: no span of slots to view in place
    a = (w.a_rows_span(*span) if span is not None else w.a_rows(g.slots)).float()  # [C, K, in]
    hs = w.split_slices(torch.bmm(xs, a.transpose(1, 2)))  # [C, M, S, r]
    # Padding rows repeat a real row; `keep` zeroes their share so they add nothing.
    hs = _rounded(hs * (g.keep[:, :, None, None] * _chunk_weights(scaling.t(), g)[:, None, :, None]), h_dtype)
    hs = hs.permute(2, 0, 1, 3)  # [S, C, M, r]
    weights = [(w.b_span(i, *span) if span is not None else w.b(i, g.slots)).float()
               for i in range(num_slices)]  # S x [C, r, n_i]
    width_out = sum(b.shape[1] for b in lora_b)
    if slice_offsets != _packed_offsets(lora_b) or y.shape[1] != width_out or not y.is_contiguous():
        for hi, wi, off in zip(hs, weights, slice_offsets):
            _add_rows(y[:, off : off + wi.shape[2]], g.rows.flatten(), torch.bmm(hi, wi).flatten(0, 1))
        return
    _add_rows(y, g.rows.flatten(), _packed_delta(hs, weights).flatten(0, 1))


def _rounded(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """h as the composed form stores it between shrink and expand (its scratch's dtype), in float32."""
    return h if dtype == torch.float32 else h.to(dtype).float()


def _packed_delta(hs: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """Every slice's delta side by side, [C, M, sum n_i], from hs [S, C, M, r] and S x [C, r, n_i].

    Wide chunks multiply once against block-diagonal weights: building them writes C x S*r x sum n_i
    values where gluing per-slice products writes C x M x sum n_i, and a last-dimension cat of wide
    blocks cost more than the matmuls.
    """
    num_slices, chunks, width, r = hs.shape
    if num_slices == 1:
        return torch.bmm(hs[0], weights[0])
    if width <= num_slices * r:
        return torch.cat([torch.bmm(hi, wi) for hi, wi in zip(hs, weights)], dim=-1)
    diag = hs.new_zeros(chunks, num_slices * r, sum(w.shape[2] for w in weights))  # [C, S*r, sum n_i]
    off = 0
    for i, wi in enumerate(weights):
        diag[:, i * r : (i + 1) * r, off : off + wi.shape[2]] = wi
        off += wi.shape[2]
    return torch.bmm(hs.permute(1, 2, 0, 3).reshape(chunks, width, num_slices * r), diag)


def _long_runs(batch: LoraBatch) -> list[tuple[int, int, int]]:
    """(start, length, slot) of each adapter run of SEGMENT_MIN_RUN tokens or more (prefill chunks)."""
    return [(start, n, s) for start, n, s in zip(*batch.runs_host) if s >= 0 and n >= SEGMENT_MIN_RUN]


class _Block(NamedTuple):
    start: int  # first token row
    rows: int  # token rows, all in runs of SEGMENT_MIN_RUN or more
    slots: torch.Tensor  # [G] int64, each run's slot
    offs: torch.Tensor  # [G] int32, each run's end row, counted from start (torch._grouped_mm's offsets)
    ends: tuple[int, ...]  # offs on the host
    row_slots: torch.Tensor  # [rows] int64, each row's slot
    runs: list[tuple[int, int, int]]  # (start, length, slot) of each run


def _long_blocks(batch: LoraBatch) -> list[_Block]:
    """Stretches of adjacent long runs (a step's prefill chunks follow each other: one stretch,
    unless a short prompt sits between two), each done by grouped matmuls; built once per step."""
    if "cpu_long_blocks" not in batch.scratch:
        stretches: list[list[tuple[int, int, int]]] = []
        for run in _long_runs(batch):
            if stretches and stretches[-1][-1][0] + stretches[-1][-1][1] == run[0]:
                stretches[-1].append(run)
            else:
                stretches.append([run])
        device = batch.token_slots.device
        blocks = []
        for runs in stretches:
            start, lens, slots = runs[0][0], [n for _, n, _ in runs], [s for _, _, s in runs]
            ends = torch.tensor(lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            rows = int(ends[-1])
            blocks.append(_Block(start, rows, torch.tensor(slots, device=device), ends.to(device),
                                 tuple(ends.tolist()), batch.token_slots[start : start + rows].long(), runs))
        batch.scratch["cpu_long_blocks"] = blocks
    return batch.scratch["cpu_long_blocks"]


class _Groups(NamedTuple):
    slots: torch.Tensor  # [C] the adapter slot of each chunk
    rows: torch.Tensor  # [C, M] token rows of each chunk; padding repeats a real row
    keep: torch.Tensor  # [C, M] float32: 1 for a real row, 0 for padding
    span: tuple[int, int] | None  # chunk c is slot lo + c, for c < hi - lo: weights are a view


def _chunk_weights(w: torch.Tensor, g: _Groups) -> torch.Tensor:
    """w [L, ...] per slot -> [C, ...] per chunk: a view of the span, else gathered."""
    return w[g.span[0] : g.span[1]] if g.span is not None else w.index_select(0, g.slots)


def _groups(batch: LoraBatch) -> _Groups | None:
    """The tokens of short runs grouped by adapter in chunks of equal width; None when there are none.

    Built once per step (all layers share it).

    When the adapters sit in slots close together and no adapter has far more tokens than the rest
    (decodes), each slot of the span is one chunk and its weights are read in place. Otherwise each
    adapter's tokens are cut into chunks of at most M = ceil(n / G) rows (n adapter tokens, G
    adapters), and every chunk is one matrix of the batched matmul, its adapter's weights gathered
    for it. Padding each adapter to its longest group instead made a step that mixes one 128-token
    prefill with 31 decode tokens compute 32 x 128 rows; chunks bound the padded rows by 2n + G
    whatever the mix.
    """
    if "cpu_groups" not in batch.scratch:
        batch.scratch["cpu_groups"] = _build_groups(batch)
    return batch.scratch["cpu_groups"]


def _build_groups(batch: LoraBatch) -> _Groups | None:
    token_slots = batch.token_slots.long()
    device = token_slots.device
    short = token_slots >= 0  # [T]
    for start, n, _ in _long_runs(batch):
        short[start : start + n] = False
    lora_rows = short.nonzero().squeeze(1)  # [n]
    if lora_rows.numel() == 0:
        return None
    order = lora_rows[torch.sort(token_slots[lora_rows], stable=True).indices]  # [n] token rows by slot
    slots, counts = torch.unique_consecutive(token_slots[order], return_counts=True)  # [G], [G]
    n, num_adapters = order.numel(), slots.numel()
    group_start = torch.cumsum(counts, 0) - counts  # [G]
    group = torch.repeat_interleave(torch.arange(num_adapters, device=device), counts)  # [n]
    pos = torch.arange(n, device=device) - group_start[group]  # [n] place in its group
    lo, hi, most = int(slots[0]), int(slots[-1]) + 1, int(counts.max())
    span = None
    if hi - lo <= 2 * num_adapters and (hi - lo) * most <= 4 * n:
        # Decodes over slots close together: one chunk per slot of the span, as wide as the busiest
        # adapter. Reading each slot's weights in place saves copying them per step, which grew with
        # the number of adapters; the padding costs rank-r products only.
        span, width, chunk_slots = (lo, hi), most, torch.arange(lo, hi, device=device)
        chunk = slots[group] - lo  # [n]
    else:
        width = -(-n // num_adapters)  # M
        chunks = (counts + width - 1) // width  # [G] chunks per adapter
        first_chunk = torch.cumsum(chunks, 0) - chunks  # [G]
        chunk = first_chunk[group] + pos // width  # [n]
        chunk_slots = torch.repeat_interleave(slots, chunks)
    picks = chunk * width + pos % width  # [n] into C*M
    num_chunks = chunk_slots.numel()
    rows = order[:1].repeat(num_chunks * width)  # [C*M], padding: a real LoRA row (its share is 0)
    rows[picks] = order
    keep = torch.zeros(num_chunks * width, dtype=torch.float32, device=device)
    keep[picks] = 1.0
    return _Groups(chunk_slots, rows.view(-1, width), keep.view(-1, width), span)


def _packed_offsets(lora_b: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    return tuple(sum(b.shape[1] for b in lora_b[:i]) for i in range(len(lora_b)))


def _add_rows(y: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor) -> None:
    """y[rows] += delta (rows may repeat: padding, whose delta is 0), rounded once to y's dtype."""
    if y.dtype == torch.float32:
        y.index_add_(0, rows, delta)
        return
    acc = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    acc.index_add_(0, rows, delta)
    y.add_(acc)  # computed in float32 and rounded once; rows without LoRA add exactly 0
