"""Triton multi-LoRA shrink/expand with the semantics of kernels.lora_ref.

Two shapes of the same math, chosen per call from the batch metadata:

- segmented (SGMV, for prefill): one program per (run of equal slots, tile of
  BLOCK_M tokens, slice[, column tile]); the adapter's weights are loaded once
  per tile and multiplied with `tl.dot`.
- gathered (BGMV, for decode): one program per (token, slice[, column tile]);
  each token gathers its own adapter's weights and reduces with a
  multiply-and-sum, which needs no 16-row minimum the way `tl.dot` does.

Slot buffers are used in place at max rank (rows beyond an adapter's own rank
are zero), so mixed ranks share a launch with no per-batch copy or padding.
Slot -1 programs exit before touching memory: shrink never writes those rows
and expand never reads or writes them.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.metadata import LoraBatch

# A batch whose longest run of equal slots is at most this is decode-shaped:
# a 16-row dot tile would be mostly padding, so each token gathers instead.
GATHER_MAX_SEG_LEN = 4
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


def _rank_block(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, scaling_ptr, out_ptr,
    seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    K, R, M_BLOCKS,
    stride_xt, stride_xk,
    stride_as, stride_al, stride_ar, stride_ak,
    stride_ss, stride_sl,
    stride_os, stride_ot, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    seg = tl.program_id(0) // M_BLOCKS
    m_blk = tl.program_id(0) % M_BLOCKS
    sl = tl.program_id(1)
    slot = tl.load(seg_slots_ptr + seg)
    seg_len = tl.load(seg_lens_ptr + seg)
    if slot < 0 or m_blk * BLOCK_M >= seg_len:
        return
    slot = slot.to(tl.int64)
    seg_start = tl.load(seg_starts_ptr + seg)
    rows = seg_start + m_blk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_ok = rows < seg_start + seg_len
    ranks = tl.arange(0, BLOCK_R)
    a_base = a_ptr + sl * stride_as + slot * stride_al
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)  # [BM, BK]
        a = tl.load(a_base + ks[:, None] * stride_ak + ranks[None, :] * stride_ar,
                    mask=(ks[:, None] < K) & (ranks[None, :] < R), other=0.0)  # [BK, BR]
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    scale = tl.load(scaling_ptr + sl * stride_ss + slot * stride_sl)
    out = (acc * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + sl * stride_os + rows[:, None] * stride_ot + ranks[None, :] * stride_or,
             out, mask=row_ok[:, None] & (ranks[None, :] < R))


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, scaling_ptr, out_ptr, token_slots_ptr,
    K, R,
    stride_xt, stride_xk,
    stride_as, stride_al, stride_ar, stride_ak,
    stride_ss, stride_sl,
    stride_os, stride_ot, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    sl = tl.program_id(1)
    slot = tl.load(token_slots_ptr + t)
    if slot < 0:
        return
    slot = slot.to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    a_base = a_ptr + sl * stride_as + slot * stride_al
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_xt + ks * stride_xk, mask=ks < K, other=0.0).to(tl.float32)  # [BK]
        a = tl.load(a_base + ranks[:, None] * stride_ar + ks[None, :] * stride_ak,
                    mask=(ranks[:, None] < R) & (ks[None, :] < K), other=0.0).to(tl.float32)  # [BR, BK]
        acc += tl.sum(a * x[None, :], axis=1)
    scale = tl.load(scaling_ptr + sl * stride_ss + slot * stride_sl)
    tl.store(out_ptr + sl * stride_os + t * stride_ot + ranks * stride_or,
             (acc * scale).to(out_ptr.dtype.element_ty), mask=ranks < R)


@triton.jit
def _pick_slice(sl, v0, v1, v2):
    """Per-slice scalar by the program's slice index (constexpr-safe, unlike an if-chain)."""
    return tl.where(sl == 0, v0, tl.where(sl == 1, v1, v2))


@triton.jit
def _sgmv_expand_kernel(
    h_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr,
    seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    R, M_BLOCKS,
    n0, n1, n2, off0, off1, off2,
    sbl0, sbn0, sbr0, sbl1, sbn1, sbr1, sbl2, sbn2, sbr2,
    stride_hs, stride_ht, stride_hr,
    stride_yt, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
):
    seg = tl.program_id(0) // M_BLOCKS
    m_blk = tl.program_id(0) % M_BLOCKS
    n_blk = tl.program_id(1)
    sl = tl.program_id(2)
    n = _pick_slice(sl, n0, n1, n2)
    slot = tl.load(seg_slots_ptr + seg)
    seg_len = tl.load(seg_lens_ptr + seg)
    if slot < 0 or m_blk * BLOCK_M >= seg_len or n_blk * BLOCK_N >= n:
        return
    if sl == 0:
        b_ptr = b0_ptr
    elif sl == 1:
        b_ptr = b1_ptr
    else:
        b_ptr = b2_ptr
    slot = slot.to(tl.int64)
    seg_start = tl.load(seg_starts_ptr + seg)
    rows = seg_start + m_blk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_ok = rows < seg_start + seg_len
    cols = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_ok = cols < n
    ranks = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + sl * stride_hs + rows[:, None] * stride_ht + ranks[None, :] * stride_hr,
                mask=row_ok[:, None] & (ranks[None, :] < R), other=0.0)  # [BM, BR]
    b = tl.load(b_ptr + slot * _pick_slice(sl, sbl0, sbl1, sbl2)
                + ranks[:, None] * _pick_slice(sl, sbr0, sbr1, sbr2)
                + cols[None, :] * _pick_slice(sl, sbn0, sbn1, sbn2),
                mask=(ranks[:, None] < R) & col_ok[None, :], other=0.0)  # [BR, BN]
    if UPCAST:
        delta = tl.dot(h.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        delta = tl.dot(h, b)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + (_pick_slice(sl, off0, off1, off2) + cols[None, :]) * stride_yn
    ok = row_ok[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bgmv_expand_kernel(
    h_ptr, y_ptr, b0_ptr, b1_ptr, b2_ptr, token_slots_ptr,
    R,
    n0, n1, n2, off0, off1, off2,
    sbl0, sbn0, sbr0, sbl1, sbn1, sbr1, sbl2, sbn2, sbr2,
    stride_hs, stride_ht, stride_hr,
    stride_yt, stride_yn,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0)
    n_blk = tl.program_id(1)
    sl = tl.program_id(2)
    n = _pick_slice(sl, n0, n1, n2)
    slot = tl.load(token_slots_ptr + t)
    if slot < 0 or n_blk * BLOCK_N >= n:
        return
    if sl == 0:
        b_ptr = b0_ptr
    elif sl == 1:
        b_ptr = b1_ptr
    else:
        b_ptr = b2_ptr
    slot = slot.to(tl.int64)
    cols = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    col_ok = cols < n
    ranks = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + sl * stride_hs + t * stride_ht + ranks * stride_hr,
                mask=ranks < R, other=0.0).to(tl.float32)  # [BR]
    b = tl.load(b_ptr + slot * _pick_slice(sl, sbl0, sbl1, sbl2)
                + cols[:, None] * _pick_slice(sl, sbn0, sbn1, sbn2)
                + ranks[None, :] * _pick_slice(sl, sbr0, sbr1, sbr2),
                mask=col_ok[:, None] & (ranks[None, :] < R), other=0.0).to(tl.float32)  # [BN, BR]
    delta = tl.sum(b * h[None, :], axis=1)  # [BN]
    y_ptrs = y_ptr + t * stride_yt + (_pick_slice(sl, off0, off1, off2) + cols) * stride_yn
    y = tl.load(y_ptrs, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=col_ok)


def use_gather(batch: LoraBatch) -> bool:
    """The entry points' choice: gathered (BGMV) for decode-shaped batches, else segmented."""
    return batch.max_seg_len <= GATHER_MAX_SEG_LEN


def _check_shrink(x: torch.Tensor, lora_a: torch.Tensor, batch: LoraBatch, scaling: torch.Tensor,
                  out: torch.Tensor) -> None:
    num_slices, _, rank, hidden = lora_a.shape
    assert x.shape == (batch.num_tokens, hidden), (x.shape, lora_a.shape)
    assert out.shape == (num_slices, batch.num_tokens, rank), out.shape
    assert scaling.shape == lora_a.shape[:2], scaling.shape


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    batch: LoraBatch,
    scaling: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Same contract as kernels.lora_ref.lora_shrink; picks the form from the batch shape.

    Shape: x [T, in]; lora_a [S, L, R, in]; scaling [S, L] float32; out [S, T, R].
    """
    if use_gather(batch):
        shrink_gathered(x, lora_a, batch, scaling, out)
    else:
        shrink_segmented(x, lora_a, batch, scaling, out)


def shrink_gathered(x: torch.Tensor, lora_a: torch.Tensor, batch: LoraBatch, scaling: torch.Tensor,
                    out: torch.Tensor) -> None:
    """lora_shrink, one program per (token, slice): each token gathers its adapter's A."""
    _check_shrink(x, lora_a, batch, scaling, out)
    if not batch.any_lora:
        return
    num_slices, _, rank, hidden = lora_a.shape
    rank = batch.effective_rank(rank)
    block_r = _rank_block(rank)
    # Bounded tile ([BLOCK_R, BLOCK_K] <= 4096 elements) keeps registers low at rank 64.
    block_k = max(16, min(triton.next_power_of_2(hidden), 4096 // block_r))
    _bgmv_shrink_kernel[(batch.num_tokens, num_slices)](
        x, lora_a, scaling, out, batch.token_slots, hidden, rank,
        *x.stride(), *lora_a.stride(), *scaling.stride(), *out.stride(),
        BLOCK_R=block_r, BLOCK_K=block_k,
    )


def _block_m(max_seg_len: int) -> int:
    return 16 if max_seg_len <= 16 else (32 if max_seg_len <= 32 else 64)


def shrink_segmented(x: torch.Tensor, lora_a: torch.Tensor, batch: LoraBatch, scaling: torch.Tensor,
                     out: torch.Tensor) -> None:
    """lora_shrink, one program per (segment tile, slice): A loaded once per tile of tokens."""
    _check_shrink(x, lora_a, batch, scaling, out)
    if not batch.any_lora:
        return
    num_slices, _, rank, hidden = lora_a.shape
    rank = batch.effective_rank(rank)
    block_r = _rank_block(rank)
    block_m = _block_m(batch.max_seg_len)
    m_blocks = triton.cdiv(batch.max_seg_len, block_m)
    _sgmv_shrink_kernel[(batch.seg_slots.shape[0] * m_blocks, num_slices)](
        x, lora_a, scaling, out, batch.seg_starts, batch.seg_lens, batch.seg_slots,
        hidden, rank, m_blocks,
        *x.stride(), *lora_a.stride(), *scaling.stride(), *out.stride(),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=128 if block_r <= 32 else 64,
        UPCAST=_upcast(x.dtype, lora_a.dtype),
    )


def lora_expand(
    h: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    batch: LoraBatch,
    y: torch.Tensor,
    slice_offsets: tuple[int, ...],
) -> None:
    """Same contract as kernels.lora_ref.lora_expand; picks the form from the batch shape.

    Up to MAX_FUSED_SLICES slices go in one launch (fused qkv, gate_up).
    Shape: h [S, T, R]; lora_b: S tensors [L, n_i, R]; y [T, >= max(off_i + n_i)].
    """
    if use_gather(batch):
        expand_gathered(h, lora_b, batch, y, slice_offsets)
    else:
        expand_segmented(h, lora_b, batch, y, slice_offsets)


def _slice_groups(h: torch.Tensor, lora_b: tuple[torch.Tensor, ...], batch: LoraBatch, y: torch.Tensor,
                  slice_offsets: tuple[int, ...]):
    """Validate, then yield (launch's slice count, its h view, its per-slice scalar args)."""
    num_slices, num_tokens, rank = h.shape
    assert len(lora_b) == num_slices == len(slice_offsets), (len(lora_b), h.shape, slice_offsets)
    assert num_tokens == batch.num_tokens and y.shape[0] == num_tokens, (h.shape, y.shape)
    for b, off in zip(lora_b, slice_offsets):
        assert b.shape[2] == rank and b.dtype == lora_b[0].dtype, (b.shape, b.dtype, h.shape)
        assert 0 <= off and off + b.shape[1] <= y.shape[1], (off, b.shape, y.shape)
    if not batch.any_lora:
        return
    for first in range(0, num_slices, MAX_FUSED_SLICES):
        group = list(range(first, min(first + MAX_FUSED_SLICES, num_slices)))
        # Unused kernel slice arguments repeat the last slice; the grid never reaches them.
        padded = group + [group[-1]] * (MAX_FUSED_SLICES - len(group))
        bs = [lora_b[i] for i in padded]
        args = (
            *bs,
            *[b.shape[1] for b in bs],
            *[slice_offsets[i] for i in padded],
            *[st for b in bs for st in b.stride()],
        )
        yield len(group), max(b.shape[1] for b in bs), h[first:], args


def expand_gathered(h: torch.Tensor, lora_b: tuple[torch.Tensor, ...], batch: LoraBatch, y: torch.Tensor,
                    slice_offsets: tuple[int, ...]) -> None:
    """lora_expand, one program per (token, column tile, slice)."""
    rank = batch.effective_rank(h.shape[2])
    block_r = _rank_block(rank)
    for count, width, h_part, args in _slice_groups(h, lora_b, batch, y, slice_offsets):
        block_n = max(16, min(triton.next_power_of_2(width), 4096 // block_r))
        grid = (batch.num_tokens, triton.cdiv(width, block_n), count)
        _bgmv_expand_kernel[grid](
            h_part, y, *args[:3], batch.token_slots, rank, *args[3:],
            *h_part.stride(), *y.stride(), BLOCK_N=block_n, BLOCK_R=block_r,
        )


def expand_segmented(h: torch.Tensor, lora_b: tuple[torch.Tensor, ...], batch: LoraBatch, y: torch.Tensor,
                     slice_offsets: tuple[int, ...]) -> None:
    """lora_expand, one program per (segment tile, column tile, slice): B loaded once per tile."""
    rank = batch.effective_rank(h.shape[2])
    block_r = _rank_block(rank)
    block_m = _block_m(batch.max_seg_len)
    m_blocks = triton.cdiv(max(batch.max_seg_len, 1), block_m)
    for count, width, h_part, args in _slice_groups(h, lora_b, batch, y, slice_offsets):
        block_n = 64 if width <= 64 or block_m == 64 else 128
        grid = (batch.seg_slots.shape[0] * m_blocks, triton.cdiv(width, block_n), count)
        _sgmv_expand_kernel[grid](
            h_part, y, *args[:3], batch.seg_starts, batch.seg_lens, batch.seg_slots,
            rank, m_blocks, *args[3:], *h_part.stride(), *y.stride(),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
            UPCAST=_upcast(h.dtype, lora_b[0].dtype),
        )
