"""Triton paged attention with the semantics of kernels.attention_ref.

One kernel body serves the varlen prefill part of a batch: fresh prefills and
chunked prefills that continue a cached prefix. A program owns one tile of one
sequence's queries and one KV head; the query heads that share that KV head
(GQA) are packed into the tile's rows, so each K/V tile is read once per group. Keys are
read through the block table one tile at a time with an online softmax
accumulated in fp32.

The step's plan (kernels.metadata) lists the programs: the other
sequences' query tiles go in one launch here, so a mixed batch launches no
program for a decode's missing query tiles; decode sequences go to
kernels.attention_decode, which splits their contexts across programs when
few sequences decode (flash-decoding).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import attention_decode
from kernels.attention_ref import is_fp8, reads_exactly, storage, stored
from kernels.metadata import AttentionBatch, AttentionLaunchPlan, attention_plan

# Rows of one program's query tile (query tokens x heads of one GQA group) for prefill, per dtype:
# fp32 products run on FMA units with both operands and the accumulator in registers, and 64 rows
# of a 128-wide head spilled 7-40 KB per program (benchmarks/aot/aot_check.py); 32 rows (with 8 warps) do not.
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_M_FP32 = 32
# Keys per inner-loop tile; independent of the pool's block size.
BLOCK_N = 32


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Semantics: k_cache.flat[slot_mapping[t]] = k[t] (v likewise), skipped when the slot is negative.
    Shape: grid (T,); k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:  # a padding token (as in vLLM): nothing to store
        return
    blk = slot // block_size
    off = slot % block_size
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    ok = (heads < num_heads) & (dims < head_dim)
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims * stride_kd, mask=ok)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kcs + heads * stride_kch + dims * stride_kcd,
             k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims * stride_vd, mask=ok)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vcs + heads * stride_vch + dims * stride_vcd,
             v.to(v_cache_ptr.dtype.element_ty), mask=ok)


_scores = attention_decode.scores


@triton.jit(do_not_specialize=["stride_btb", "window"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, tiles_ptr,
    qk_scale, cap_in, cap_out, window, head_dim, block_size,
    stride_qt, stride_qh, stride_qd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_ot, stride_oh, stride_od,
    stride_btb, stride_btj,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Semantics: program (tile, kv head) computes causal attention for query tile q_blk of sequence
    seq, (seq, q_blk) = tiles[tile], for the GROUP query heads of its kv head; each query sees the
    `window` keys up to its own (soft_capped: kernels.attention_ref.paged_attention).
    Shape: grid (tiles, Hkv); q, out [T, Hq, D]; caches [num_blocks, block_size, Hkv, D];
    block_tables [B, W] (W, its row stride, changes every step: not specialised on)."""
    seq = tl.load(tiles_ptr + tl.program_id(0) * 2)
    q_blk = tl.load(tiles_ptr + tl.program_id(0) * 2 + 1)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    # Row r of the tile is query token q_blk*BLOCK_Q + r // GROUP, head kv_head*GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_blk * BLOCK_Q + rows // GROUP  # [BM]
    head = kv_head * GROUP + rows % GROUP  # [BM]
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len + q_idx  # [BM] absolute position, the causal limit
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + (q_start + q_idx)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
                + dims[None, :] * stride_qd, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BM, BD]
    if UPCAST:
        q = q.to(tl.float32)

    # Keys beyond the tile's last query are masked for every row: never load them.
    kv_end = tl.minimum(seq_len, ctx_len + tl.minimum(q_len, (q_blk + 1) * BLOCK_Q))
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: padded rows stay NaN-free
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_btb
    # Keys before the tile's first query's window are masked for every row: never load them.
    kv_start = tl.maximum(ctx_len + q_blk * BLOCK_Q - window + 1, 0)
    for k0 in range(kv_start, kv_end, BLOCK_N):
        kpos = k0 + tl.arange(0, BLOCK_N)  # [BN]
        k_ok = kpos < kv_end
        blk = tl.load(table + (kpos // block_size) * stride_btj, mask=k_ok, other=0).to(tl.int64)
        off = kpos % block_size
        kv_ok = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + blk[:, None] * stride_kcb + off[:, None] * stride_kcs
                    + kv_head * stride_kch + dims[None, :] * stride_kcd, mask=kv_ok, other=0.0)  # [BN, BD]
        v = tl.load(v_cache_ptr + blk[:, None] * stride_vcb + off[:, None] * stride_vcs
                    + kv_head * stride_vch + dims[None, :] * stride_vcd, mask=kv_ok, other=0.0)  # [BN, BD]
        if UPCAST:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            k = k.to(q.dtype)  # an fp8 cache's values are exact in bf16 / fp16: tensor cores stay in use
            v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k))
        s = _scores(s, qk_scale, cap_in, cap_out, SOFTCAP)  # [BM, BN], log2 domain
        visible = k_ok[None, :] & (kpos[None, :] <= q_pos[:, None]) & (kpos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + q_idx)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
             + dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as kernels.attention_ref.write_kv (a negative slot is skipped).

    Semantics: k_cache.flat[slot_mapping[t]] = k[t] in the cache's dtype; v_cache likewise. An fp8
        cache gets torch's saturating cast (kernels.attention_ref), which the kernel then copies as bytes.
    Shape: k, v [T, Hkv, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; slot_mapping [T].
    """
    if is_fp8(k_cache.dtype):
        k, v, k_cache, v_cache = stored(k, k_cache), stored(v, v_cache), storage(k_cache), storage(v_cache)
    num_tokens, num_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape, (k.shape, v.shape, k_cache.shape)
    assert k_cache.shape[2:] == (num_heads, head_dim), (k.shape, k_cache.shape)
    assert slot_mapping.shape == (num_tokens,), slot_mapping.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_heads, head_dim, k_cache.shape[1],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    out: torch.Tensor,
    softcap: float | None = None,
    window: int | None = None,
) -> None:
    """Same contract as kernels.attention_ref.paged_attention.

    Semantics: out[t] = softmax(scale * q[t] @ K[:p+1].T) @ V[:p+1] per sequence, p the query's position.
    Shape: q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; out [T, Hq, D].
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert out.shape == q.shape and k_cache.shape == v_cache.shape, (out.shape, q.shape)
    assert k_cache.shape[3] == head_dim, (k_cache.shape, q.shape)
    if num_tokens == 0 or batch.num_seqs == 0:
        return
    group = num_q_heads // num_kv_heads
    rows = PREFILL_BLOCK_M_FP32 if q.dtype == torch.float32 else PREFILL_BLOCK_M
    prefill_m = max(rows, triton.next_power_of_2(group))
    plan = step_plan(batch, prefill_m // group, num_kv_heads, q.device)
    scores = attention_decode.Scores.of(scale, softcap, window)
    if plan.num_decode:
        attention_decode.decode(q, k_cache, v_cache, batch, plan, scores, out, BLOCK_N)
    if plan.num_prefill_tiles:
        _launch(q, k_cache, v_cache, batch, plan.prefill, scores, out, block_q=prefill_m // group, block_m=prefill_m)


def step_plan(batch: AttentionBatch, block_q: int, num_kv_heads: int, device) -> AttentionLaunchPlan:
    """The step's plan for this model's query tile height; built by the first layer, reused by the rest."""
    key = ("attention", block_q, num_kv_heads)
    if key not in batch.scratch:
        batch.scratch[key] = attention_plan(batch.query_lens_host, batch.seq_lens_host, block_q, num_kv_heads,
                                            BLOCK_N, device)
    return batch.scratch[key]


def _launch(q, k_cache, v_cache, batch: AttentionBatch, tiles: torch.Tensor, scores, out,
            block_q: int, block_m: int) -> None:
    num_q_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    upcast = _interpreting() or q.dtype == torch.float32 or not reads_exactly(k_cache.dtype, q.dtype)
    _paged_attention_kernel[(tiles.shape[0], num_kv_heads)](
        q, k_cache, v_cache, out,
        batch.block_tables, batch.query_start_loc, batch.seq_lens, tiles,
        scores.qk_scale, scores.cap_in, scores.cap_out, scores.window, head_dim, block_size,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *batch.block_tables.stride(),
        GROUP=num_q_heads // num_kv_heads, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), UPCAST=upcast, SOFTCAP=scores.softcap,
        num_warps=attention_decode.num_warps(q.dtype),
    )
