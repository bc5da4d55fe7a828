"""Plain-torch multi-LoRA shrink/expand: the semantics the Triton kernels implement.

Slot buffers hold every loaded adapter at the maximum rank; rows beyond an
adapter's own rank are zero (the slot is zero-filled before reuse), so only
the first `batch.rank_bound` rank columns carry anything and the rest are
skipped. Two forms, chosen per run of one adapter's consecutive tokens (a step
may use both; profiled with scripts/profile_step.py):

- gathered chunks, for short runs (decodes): however many
  adapters a batch mixes, each projection's LoRA is a fixed handful of ops.
  The adapter tokens are cut into chunks of one width (each one adapter's),
  each chunk's weights are gathered (or, when the step's slots lie close
  together, read in place), one batched matmul per side does every
  chunk and fused slice at once, and the deltas land on the base output with
  one contiguous index_add_. A loop per adapter or per slice made the op
  count, not the math, dominate such steps.
- segments, for long runs (prefill chunks): a matmul per run, added in
  place onto the base output's rows; gathering and scattering prefill-sized
  deltas cost more than the matmuls.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.metadata import LoraBatch

SEGMENT_MIN_RUN = 32  # adapter tokens in a run from which a matmul of its own beats gathered chunks


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
    num_slices, r = lora_a.shape[0], batch.effective_rank(lora_a.shape[2])
    for start, n, s in _long_runs(batch):
        a = lora_a[:, s, :r].reshape(num_slices * r, x.shape[1]).float()  # [S*r, in]
        hs = torch.mm(x[start : start + n].float(), a.t()).view(n, num_slices, r)  # [n, S, r]
        out[:, start : start + n, :r] = (hs * scaling[:, s, None]).transpose(0, 1).to(out.dtype)
    g = _groups(batch)
    if g is None:
        return
    chunks, width = g.rows.shape
    xs = x[g.rows].float()  # [C, M, in]
    if g.span is None:
        a = lora_a[:, :, :r].transpose(0, 1).index_select(0, g.slots)  # [C, S, r, in]
        a = a.view(chunks, num_slices * r, x.shape[1]).float()  # [C, S*r, in]: the slices' rows stacked
        h = torch.bmm(xs, a.transpose(1, 2)).view(chunks, width, num_slices, r)  # [C, M, S, r]
    else:  # the slots' own rows, read in place: no copy of the weights
        h = torch.stack([torch.bmm(xs, _chunk_weights(a[:, :r], g).float().transpose(1, 2)) for a in lora_a], 2)
    h = h * scaling.index_select(1, g.slots).t()[:, None, :, None]  # [C, 1, S, 1] per chunk and slice
    h = h.flatten(0, 1).index_select(0, g.picks)  # [n, S, r], the real rows
    out[:, :, :r].index_copy_(1, g.flat, h.transpose(0, 1).to(out.dtype))


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
    for start, n, s in _long_runs(batch):
        for i, (b, off) in enumerate(zip(lora_b, slice_offsets)):
            dst = y[start : start + n, off : off + b.shape[1]]  # [n, n_i]
            hs, bs = h[i, start : start + n, :r], b[s, :, :r]  # [n, r], [n_i, r]
            if y.dtype == torch.float32:
                dst.addmm_(hs.float(), bs.float().t())  # in place: no delta the size of the output
            else:
                dst.copy_(dst.float().addmm_(hs.float(), bs.float().t()))  # rounded once
    g = _groups(batch)
    if g is None:
        return
    # Padding rows repeat a real LoRA row; `keep` zeroes their share so they add nothing.
    hs = h[:, :, :r][:, g.rows].float() * g.keep[None, :, :, None]  # [S, C, M, r]
    gathered = [_chunk_weights(b[:, :, :r], g).float() for b in lora_b]  # S x [C, n_i, r]
    width_out = sum(b.shape[1] for b in lora_b)
    if slice_offsets != _packed_offsets(lora_b) or y.shape[1] != width_out or not y.is_contiguous():
        for hi, bi, off in zip(hs, gathered, slice_offsets):
            _add_rows(y[:, off : off + bi.shape[1]], g.rows.flatten(), torch.bmm(hi, bi.transpose(1, 2)).flatten(0, 1))
        return
    _add_rows(y, g.rows.flatten(), _packed_delta(hs, gathered).flatten(0, 1))


def _packed_delta(hs: torch.Tensor, gathered: list[torch.Tensor]) -> torch.Tensor:
    """Every slice's delta side by side, [C, M, sum n_i], from hs [S, C, M, r] and S x [C, n_i, r].

    Wide chunks (prefill) multiply once against block-diagonal weights: building them writes
    C x S*r x sum n_i values where gluing per-slice products writes C x M x sum n_i, and a
    last-dimension cat of prefill-sized blocks cost more than the matmuls.
    """
    num_slices, chunks, width, r = hs.shape
    if num_slices == 1:
        return torch.bmm(hs[0], gathered[0].transpose(1, 2))
    if width <= num_slices * r:
        return torch.cat([torch.bmm(hi, bi.transpose(1, 2)) for hi, bi in zip(hs, gathered)], dim=-1)
    diag = hs.new_zeros(chunks, num_slices * r, sum(b.shape[1] for b in gathered))  # [C, S*r, sum n_i]
    off = 0
    for i, bi in enumerate(gathered):
        diag[:, i * r : (i + 1) * r, off : off + bi.shape[1]] = bi.transpose(1, 2)
        off += bi.shape[1]
    return torch.bmm(hs.permute(1, 2, 0, 3).reshape(chunks, width, num_slices * r), diag)


def _long_runs(batch: LoraBatch) -> list[tuple[int, int, int]]:
    """(start, length, slot) of each adapter run of SEGMENT_MIN_RUN tokens or more (prefill chunks):
    each is a matmul straight on its rows, with no gather, padding or output-sized delta."""
    return [(start, n, s) for start, n, s in zip(*batch.runs_host) if s >= 0 and n >= SEGMENT_MIN_RUN]


class _Groups(NamedTuple):
    slots: torch.Tensor  # [C] the adapter slot of each chunk
    rows: torch.Tensor  # [C, M] token rows of each chunk; padding repeats a real row
    keep: torch.Tensor  # [C, M] float32: 1 for a real row, 0 for padding
    picks: torch.Tensor  # [n] the real entries of a flattened [C*M]
    flat: torch.Tensor  # [n] their token rows
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
    if "groups" not in batch.scratch:
        token_slots = batch.token_slots.long()
        device = token_slots.device
        short = token_slots >= 0  # [T]
        for start, n, _ in _long_runs(batch):
            short[start : start + n] = False
        lora_rows = short.nonzero().squeeze(1)  # [n]
        if lora_rows.numel() == 0:
            batch.scratch["groups"] = None
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
            # Decodes over slots close together: one chunk per slot of the span, as wide as the
            # busiest adapter. Reading each slot's weights in place saves copying them per step,
            # which grew with the number of adapters; the padding costs rank-r products only.
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
        batch.scratch["groups"] = _Groups(chunk_slots, rows.view(-1, width), keep.view(-1, width), picks, order,
                                          span)
    return batch.scratch["groups"]


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
