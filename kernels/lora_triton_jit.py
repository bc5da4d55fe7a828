"""The @triton.jit bodies of the multi-LoRA shrink/expand (entry points: kernels.lora_triton).

Argument conventions shared by all four:
- x [T, in], out / h [S, T, R], y [T, >= off_i + n_i]: token rows, addressed in int64;
- lora_a [S, L, R, in], b_i [L, n_i, R], scaling [S, L] float32: slot buffers at max rank;
- gather [n, 2] int32 (token, slot) and tiles [n, 4] int32 (first token, rows, slot, 0):
  the step's plan (kernels.metadata), one program (row of the grid's axis 0) per entry; an
  entry of slot -1 (a padded decode batch's base-model and padding rows, its unused tiles) exits at once;
- INDEXED (the segmented kernels): a tile's row m is token row order[first + m] (order [rows] int32,
  idx_ptr: a padded decode step's rows sorted by slot, kernels.sorted_tiles), not first + m;
- R: the effective rank (columns past it are not computed); never specialised on, it changes
  from step to step. Nor is stride_sl (the slice count, scalings being stored slot-major), so one
  variant serves every projection group. The gathered kernels also read each slot's own rank
  (slot_ranks [L] int32) and go no further than it, so their bytes follow the adapter's rank,
  not the slots' maximum.
- the split form (SPLIT) of both pairs: the shrink splits K over programs, each writing its share
  as an fp32 partial p [splits, S, rows, R] (gathered: indexed by the entry, not the token), and the expand
  sums the partials in split order before its product: no atomics, so the result is the same bit
  for bit on every run. The split count comes from the grid (shrink) or `num_splits` (expand), both
  fixed per shape and decode bucket (kernels.metadata.shrink_splits); never specialised on.
- PAGED: the buffers are pages of PAGE rank rows (kernels.lora_pages), lora_a [S, P, PAGE, in] and b_i
  [P, n_i, PAGE], and rank row r of a slot is row r % PAGE of page table[slot, r // PAGE] (table
  [L, pages] int32, row stride stride_tl): one more load per rank tile, the weights' bytes unchanged.
  Unpaged, the slot index is the buffer index and r the row (table unread).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pick_slice(sl, v0, v1, v2):
    """Per-slice scalar by the program's slice index (constexpr-safe, unlike an if-chain)."""
    return tl.where(sl == 0, v0, tl.where(sl == 1, v1, v2))


@triton.jit
def _slice_of(c, nb0, nb1):
    """(slice, column tile within it) of flat column tile c; slices 0 and 1 have nb0 and nb1 tiles."""
    sl = (c >= nb0).to(tl.int32) + (c >= nb0 + nb1).to(tl.int32)
    return sl, c - tl.where(sl == 0, 0, tl.where(sl == 1, nb0, nb0 + nb1))


@triton.jit
def _rank_rows(table_ptr, stride_tl, slot, ranks, rank_ok, stride_l, stride_r, PAGED: tl.constexpr,
               PAGE: tl.constexpr):
    """[BR] int64 element offsets of a slot's rank rows `ranks` in a buffer of (slot or page, row) strides
    (stride_l, stride_r): through the page table when PAGED (rows past rank_ok read page 0, the zero page)."""
    if PAGED:
        page = tl.load(table_ptr + slot * stride_tl + ranks // PAGE, mask=rank_ok, other=0).to(tl.int64)
        offs = page * stride_l + (ranks % PAGE).to(tl.int64) * stride_r
    else:
        offs = slot * stride_l + ranks.to(tl.int64) * stride_r
    return offs


@triton.jit
def _tile(tiles_ptr, tile):
    """(first token or order index, rows, slot) of a segmented program's tile, as int64 / int32 / int64."""
    start = tl.load(tiles_ptr + tile * 4).to(tl.int64)
    length = tl.load(tiles_ptr + tile * 4 + 1)
    slot = tl.load(tiles_ptr + tile * 4 + 2).to(tl.int64)
    return start, length, slot


@triton.jit
def _tile_rows(idx_ptr, start, offs_m, row_ok, INDEXED: tl.constexpr):
    """[BM] int64 token rows of a tile: order[start + m] when INDEXED (masked rows read row 0), else start + m."""
    if INDEXED:
        rows = tl.load(idx_ptr + start + offs_m, mask=row_ok, other=0).to(tl.int64)
    else:
        rows = start + offs_m
    return rows


@triton.jit
def _rank_end(ranks_ptr, slot, R, INDEXED: tl.constexpr):
    """The rank a segmented program goes to: min(R, slot_ranks[slot]) when INDEXED (a padded step's slots are
    all taken at the buffers' rank, so the slot's own bounds the bytes, as in the gathered kernels), else R
    (an eager step's R is already its active adapters' highest)."""
    if INDEXED:
        end = tl.minimum(R, tl.load(ranks_ptr + slot))
    else:
        end = R
    return end


@triton.jit
def _k_split(K, R, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """(split, rank tile, first feature, end feature) of a split-K shrink program: grid axis 2 is
    (split, rank tile), so the split count is the grid's and no argument carries it; each split takes
    cdiv(cdiv(K, splits), BLOCK_K) x BLOCK_K features (the last ones may have none)."""
    r_tiles = tl.cdiv(R, BLOCK_R)
    split = tl.program_id(2) // r_tiles
    chunk = tl.cdiv(tl.cdiv(K, tl.num_programs(2) // r_tiles), BLOCK_K) * BLOCK_K
    k_lo = split * chunk
    return split, tl.program_id(2) % r_tiles, k_lo, tl.minimum(K, k_lo + chunk)


@triton.jit(do_not_specialize=["R", "stride_sl"])
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, scaling_ptr, out_ptr, tiles_ptr, idx_ptr, ranks_ptr, table_ptr,
    K, R, stride_tl,
    stride_xt, stride_xk,
    stride_as, stride_al, stride_ar, stride_ak,
    stride_ss, stride_sl,
    stride_os, stride_ot, stride_or, stride_op,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, INDEXED: tl.constexpr,
):
    """Semantics: program (tile, slice i, rank tile) writes out[i, rows, ranks] = scaling[i, slot] *
    x[rows] @ lora_a[i, slot, ranks].T for the tile's rows (< BLOCK_M; INDEXED: through order) and ranks
    (< R; INDEXED: < min(R, slot_ranks[slot]), those columns of out past it never written, as in
    _bgmv_shrink_kernel); a tile of slot -1 writes nothing. SPLIT: program
    (tile, slice i, split j x rank tiles + rank tile) writes the same over split j's features only
    (_k_split), unrounded, into the partial out[j, i, rows, ranks].
    Shape: grid (tiles, S, splits x cdiv(R, BLOCK_R)), splits 1 unless SPLIT; K = in features; out
    [S, T, R] in its dtype, or SPLIT: [splits, S, >= T, R] float32 with stride_op between splits (0
    unless SPLIT)."""
    tile = tl.program_id(0)
    sl = tl.program_id(1).to(tl.int64)
    start, length, slot = _tile(tiles_ptr, tile)
    if slot < 0:  # an unused entry of a padded decode step's fixed-size table: no work
        return
    r_tile = tl.program_id(2)
    k_lo = 0
    k_hi = K
    out_base = out_ptr
    if SPLIT:
        split, r_tile, k_lo, k_hi = _k_split(K, R, BLOCK_R, BLOCK_K)
        out_base = out_ptr + split.to(tl.int64) * stride_op
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < length
    rows = _tile_rows(idx_ptr, start, offs_m, row_ok, INDEXED)  # [BM] int64
    rank_end = _rank_end(ranks_ptr, slot, R, INDEXED)
    if r_tile * BLOCK_R >= rank_end:  # a rank tile past the slot's own rank: nothing to read
        return
    ranks = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < rank_end
    a_rows = a_ptr + sl * stride_as + _rank_rows(table_ptr, stride_tl, slot, ranks, rank_ok, stride_al, stride_ar,
                                                 PAGED, PAGE)  # [BR]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & (ks[None, :] < k_hi), other=0.0)  # [BM, BK]
        a = tl.load(a_rows[None, :] + ks[:, None] * stride_ak,
                    mask=(ks[:, None] < k_hi) & rank_ok[None, :], other=0.0)  # [BK, BR]
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    scale = tl.load(scaling_ptr + sl * stride_ss + slot * stride_sl)
    out = (acc * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_base + sl * stride_os + rows[:, None] * stride_ot + ranks[None, :] * stride_or,
             out, mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit(do_not_specialize=["R", "stride_sl"])
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, scaling_ptr, out_ptr, gather_ptr, ranks_ptr, table_ptr,
    K, R, stride_tl,
    stride_xt, stride_xk,
    stride_as, stride_al, stride_ar, stride_ak,
    stride_ss, stride_sl,
    stride_os, stride_ot, stride_or, stride_op,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PAGED: tl.constexpr,
    PAGE: tl.constexpr,
):
    """Semantics: program (entry, slice i, rank tile) writes out[i, t, ranks] = scaling[i, slot] *
    x[t] @ lora_a[i, slot, ranks].T for its (token t, slot) and ranks < min(R, slot_ranks[slot]) (the
    slot's rows past its own rank are zero: never read, and those columns of out never written),
    reducing in fp32 registers. SPLIT: program (entry, slice i, split j x rank tiles + rank tile) writes
    the same over split j's features only (_k_split; a split past K writes zeros), unrounded, into the
    partial out[j, i, entry, ranks].
    Shape: grid (gathered tokens, S, splits x cdiv(R, BLOCK_R)), splits 1 unless SPLIT; out [S, T, R] in
    its dtype, or SPLIT: [splits, S, >= entries, R] float32 with stride_op between splits (0 unless
    SPLIT); slot_ranks (ranks_ptr) [L] int32."""
    entry = tl.program_id(0)
    sl = tl.program_id(1).to(tl.int64)
    t = tl.load(gather_ptr + entry * 2).to(tl.int64)
    slot = tl.load(gather_ptr + entry * 2 + 1).to(tl.int64)
    if slot < 0:  # a base-model or padding row of a padded decode batch's work list: no work
        return
    r_tile = tl.program_id(2)
    k_lo = 0
    k_hi = K
    row = t
    out_base = out_ptr
    if SPLIT:
        split, r_tile, k_lo, k_hi = _k_split(K, R, BLOCK_R, BLOCK_K)
        row = entry.to(tl.int64)
        out_base = out_ptr + split.to(tl.int64) * stride_op
    rank_end = tl.minimum(R, tl.load(ranks_ptr + slot))
    if r_tile * BLOCK_R >= rank_end:  # a rank tile past the slot's own rank: nothing to read
        return
    ranks = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < rank_end
    a_rows = a_ptr + sl * stride_as + _rank_rows(table_ptr, stride_tl, slot, ranks, rank_ok, stride_al, stride_ar,
                                                 PAGED, PAGE)  # [BR]
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_xt + ks * stride_xk, mask=ks < k_hi, other=0.0).to(tl.float32)  # [BK]
        a = tl.load(a_rows[:, None] + ks[None, :] * stride_ak,
                    mask=rank_ok[:, None] & (ks[None, :] < k_hi), other=0.0).to(tl.float32)  # [BR, BK]
        acc += tl.sum(a * x[None, :], axis=1)
    scale = tl.load(scaling_ptr + sl * stride_ss + slot * stride_sl)
    tl.store(out_base + sl * stride_os + row * stride_ot + ranks * stride_or,
             (acc * scale).to(out_ptr.dtype.element_ty), mask=rank_ok)


@triton.jit(do_not_specialize=["R", "nb0", "nb1", "num_splits"])
def _sgmv_expand_kernel(
    h_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr, tiles_ptr, idx_ptr, ranks_ptr, table_ptr,
    R, num_splits, stride_tl,
    n0, n1, n2, off0, off1, off2, nb0, nb1,
    sbl0, sbn0, sbr0, sbl1, sbn1, sbr1, sbl2, sbn2, sbr2,
    stride_hs, stride_ht, stride_hr, stride_hp,
    stride_yt, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, INDEXED: tl.constexpr,
):
    """Semantics: program (tile, column tile c) adds h[i, rows, :R] @ b_i[slot, cols, :R].T onto
    y[rows, off_i + cols], where (i, cols) is column tile c of the slices taken in order (nb0 tiles
    of slice 0, nb1 of slice 1, the rest of slice 2); rank is looped over in BLOCK_R steps (INDEXED: up to
    min(R, slot_ranks[slot])); rows as in _sgmv_shrink_kernel (INDEXED: through order; a tile of slot -1
    adds nothing). SPLIT:
    h[i, rows] is the sum of the shrink's partials p[j, i, rows] over j = 0 .. num_splits - 1, added
    in that order in fp32 (deterministic), then taken to b's dtype for the product unless UPCAST.
    Shape: grid (tiles, total column tiles); h [S, T, R], or SPLIT: p [num_splits, S, >= T, R] float32
    with stride_hp between splits (num_splits 1 and stride_hp 0 unless SPLIT)."""
    tile = tl.program_id(0)
    sl, n_blk = _slice_of(tl.program_id(1), nb0, nb1)
    if sl == 0:
        b_ptr = b0_ptr
    elif sl == 1:
        b_ptr = b1_ptr
    else:
        b_ptr = b2_ptr
    start, length, slot = _tile(tiles_ptr, tile)
    if slot < 0:  # an unused entry of a padded decode step's fixed-size table: no work
        return
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < length
    rows = _tile_rows(idx_ptr, start, offs_m, row_ok, INDEXED)  # [BM] int64
    cols = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_ok = cols < _pick_slice(sl, n0, n1, n2)
    h_base = h_ptr + sl.to(tl.int64) * stride_hs + rows[:, None] * stride_ht
    b_base = b_ptr + cols[None, :] * _pick_slice(sl, sbn0, sbn1, sbn2)
    sbl = _pick_slice(sl, sbl0, sbl1, sbl2)
    sbr = _pick_slice(sl, sbr0, sbr1, sbr2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rank_end = _rank_end(ranks_ptr, slot, R, INDEXED)
    for r0 in range(0, rank_end, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank_end
        h = tl.load(h_base + ranks[None, :] * stride_hr, mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        if SPLIT:
            for j in range(1, num_splits):  # in split order: the same sum on every run
                h += tl.load(h_base + j * stride_hp + ranks[None, :] * stride_hr,
                             mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        b_rows = _rank_rows(table_ptr, stride_tl, slot, ranks, rank_ok, sbl, sbr, PAGED, PAGE)  # [BR]
        b = tl.load(b_base + b_rows[:, None], mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(h.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(h.to(b.dtype), b)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + (_pick_slice(sl, off0, off1, off2) + cols[None, :]) * stride_yn
    ok = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["R", "nb0", "nb1", "num_splits"])
def _bgmv_expand_kernel(
    h_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr, gather_ptr, ranks_ptr, table_ptr,
    R, num_splits, stride_tl,
    n0, n1, n2, off0, off1, off2, nb0, nb1,
    sbl0, sbn0, sbr0, sbl1, sbn1, sbr1, sbl2, sbn2, sbr2,
    stride_hs, stride_ht, stride_hr, stride_hp,
    stride_yt, stride_yn,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr, PAGED: tl.constexpr,
    PAGE: tl.constexpr,
):
    """Semantics: program (entry, column tile c) adds h[i, t, :r] @ b_i[slot, cols, :r].T onto
    y[t, off_i + cols] for its (token t, slot), r = min(R, slot_ranks[slot]); column tiles as in
    _sgmv_expand_kernel. SPLIT: h[i, t] is the sum of the shrink's partials p[j, i, entry] over
    j = 0 .. num_splits - 1, added in that order in fp32 (deterministic, never rounded).
    Shape: grid (gathered tokens, total column tiles); h [S, T, R], or SPLIT: p [num_splits, S, >= entries,
    R] float32 with stride_hp between splits (num_splits 1 and stride_hp 0 unless SPLIT); slot_ranks
    (ranks_ptr) [L] int32."""
    entry = tl.program_id(0)
    sl, n_blk = _slice_of(tl.program_id(1), nb0, nb1)
    if sl == 0:
        b_ptr = b0_ptr
    elif sl == 1:
        b_ptr = b1_ptr
    else:
        b_ptr = b2_ptr
    t = tl.load(gather_ptr + entry * 2).to(tl.int64)
    slot = tl.load(gather_ptr + entry * 2 + 1).to(tl.int64)
    if slot < 0:  # a base-model or padding row of a padded decode batch's work list: no work
        return
    row = t
    if SPLIT:  # the partials are indexed by the entry, so their size follows the gathered tokens
        row = entry.to(tl.int64)
    rank_end = tl.minimum(R, tl.load(ranks_ptr + slot))
    cols = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_ok = cols < _pick_slice(sl, n0, n1, n2)
    h_base = h_ptr + sl.to(tl.int64) * stride_hs + row * stride_ht
    b_base = b_ptr + cols[:, None] * _pick_slice(sl, sbn0, sbn1, sbn2)
    sbl = _pick_slice(sl, sbl0, sbl1, sbl2)
    sbr = _pick_slice(sl, sbr0, sbr1, sbr2)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank_end, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank_end
        h = tl.load(h_base + ranks * stride_hr, mask=rank_ok, other=0.0).to(tl.float32)  # [BR]
        if SPLIT:
            for j in range(1, num_splits):  # in split order: the same sum on every run
                h += tl.load(h_base + j * stride_hp + ranks * stride_hr, mask=rank_ok, other=0.0)
        b_rows = _rank_rows(table_ptr, stride_tl, slot, ranks, rank_ok, sbl, sbr, PAGED, PAGE)  # [BR]
        b = tl.load(b_base + b_rows[None, :], mask=col_ok[:, None] & rank_ok[None, :],
                    other=0.0).to(tl.float32)  # [BN, BR]
        acc += tl.sum(b * h[None, :], axis=1)
    y_ptrs = y_ptr + t * stride_yt + (_pick_slice(sl, off0, off1, off2) + cols) * stride_yn
    y = tl.load(y_ptrs, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=col_ok)
