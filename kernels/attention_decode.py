"""Decode attention (one query per sequence), its context split across programs when few decode.

One program per (decode sequence, kv head) leaves most of a GPU idle at small
batch: batch 1 on Llama-3-8B is 8 programs on a 132-SM H100. So each
sequence's context is cut into splits of `split_len` keys (flash-decoding); a
program computes the unnormalised softmax numerator, running max and
denominator of its split (fp32, log2 domain), and a second kernel combines the
splits per (sequence, query head) exactly:
out = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s. Splits past a
shorter sequence's end exit at once and the combine never reads them. With
one split (many sequences) the program writes its output directly. The split
count is a runtime value: one compiled variant serves every batch.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_ref import reads_exactly
from kernels.metadata import AttentionBatch, AttentionLaunchPlan


def num_warps(dtype: torch.dtype) -> int:
    """Warps per attention program: fp32 products run on FMA units with their operands in registers,
    and 4 warps needed 255 registers and spilled 1.2-1.3 KB on sm_90 (benchmarks/aot/aot_check.py); 8 do not."""
    return 8 if dtype == torch.float32 else 4


# A window wider than any context: no window, without a second compiled variant.
NO_WINDOW = 1 << 30


@dataclass(frozen=True)
class Scores:
    """How the attention kernels turn q . k into log2-domain scores: x = scale * q . k, then
    softcap * tanh(x / softcap) with a softcap (cap_in = scale / softcap, cap_out = softcap * log2 e),
    x * log2 e without (qk_scale); keys more than `window` back from the query are not seen."""
    qk_scale: float
    cap_in: float
    cap_out: float
    softcap: bool
    window: int

    @classmethod
    def of(cls, scale: float, softcap: float | None, window: int | None) -> "Scores":
        cap = softcap or 1.0
        return cls(scale * math.log2(math.e), scale / cap, cap * math.log2(math.e), softcap is not None,
                   NO_WINDOW if window is None else window)


@triton.jit
def scores(s, qk_scale, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """Raw q . k products [BM, BN] -> log2-domain scores (Scores)."""
    if SOFTCAP:
        x = s * cap_in
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp overflows to inf: 1; underflows: -1).
        return (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * cap_out
    return s * qk_scale


@triton.jit(do_not_specialize=["split_len", "num_splits", "stride_btb", "window"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, acc_ptr, ml_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, decode_ptr,
    qk_scale, cap_in, cap_out, window, head_dim, block_size, split_len, num_splits, num_q_heads,
    stride_qt, stride_qh, stride_qd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_ot, stride_oh, stride_od,
    stride_btb, stride_btj,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Semantics: program (entry, kv head, split s) over keys [s*split_len, min((s+1)*split_len, seq_len))
    of sequence decode[entry, 0], per query head h of the group: with one split, out[q row, h] =
    softmax attention; else acc[entry, h, s] = sum_k exp2(x_k - m) v_k and ml[entry, h, s] =
    (m, sum_k exp2(x_k - m)), x_k = the log2-domain score (Scores), for _combine_splits_kernel. Keys
    before the window (the last `window` of the sequence) are skipped.
    Shape: grid (decodes, Hkv, num_splits); q, out [T, Hq, D]; acc [n, Hq, num_splits, D] and
    ml [n, Hq, num_splits, 2] float32 contiguous (unused with one split); caches [num_blocks,
    block_size, Hkv, D]; block_tables [B, W]."""
    entry = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(decode_ptr + entry * 2)
    seq_len = tl.load(seq_lens_ptr + seq)
    k_start = split * split_len
    if k_start >= seq_len:
        return
    k_end = tl.minimum(seq_len, k_start + split_len)
    # A split wholly before the window loops zero times and leaves (m, l) = (-1e30, 0): no weight.
    k_start = tl.maximum(k_start, seq_len - window)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows % GROUP  # [BM]
    row_ok = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + q_row * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BM, BD]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_btb
    for k0 in range(k_start, k_end, BLOCK_N):
        kpos = k0 + tl.arange(0, BLOCK_N)  # [BN]
        k_ok = kpos < k_end
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
        s = tl.where(k_ok[None, :], scores(s, qk_scale, cap_in, cap_out, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if num_splits == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_row * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        return
    part = (entry * num_q_heads + head) * num_splits + split  # [BM] int64: (entry, head, split)
    tl.store(acc_ptr + part[:, None] * head_dim + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["split_len", "num_splits"])
def _combine_splits_kernel(
    acc_ptr, ml_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, decode_ptr,
    head_dim, split_len, num_splits, num_q_heads,
    stride_ot, stride_oh, stride_od,
    BLOCK_D: tl.constexpr,
):
    """Semantics: out[q row of decode[entry], h] = sum_s exp2(m_s - M) acc[entry, h, s] /
    sum_s exp2(m_s - M) l_s over the sequence's splits, M = max_s m_s.
    Shape: grid (decodes, Hq); acc, ml as in _decode_kernel; out [T, Hq, D]."""
    entry = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq = tl.load(decode_ptr + entry * 2)
    used = tl.cdiv(tl.load(seq_lens_ptr + seq), split_len)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    base = (entry * num_q_heads + head) * num_splits
    m = tl.full((1,), -1.0e30, dtype=tl.float32)
    denom = tl.zeros((1,), dtype=tl.float32)
    total = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s in range(0, used):
        m_s = tl.load(ml_ptr + (base + s) * 2 + tl.zeros((1,), dtype=tl.int32))
        l_s = tl.load(ml_ptr + (base + s) * 2 + 1 + tl.zeros((1,), dtype=tl.int32))
        acc_s = tl.load(acc_ptr + (base + s) * head_dim + dims, mask=dim_ok, other=0.0)
        m_new = tl.maximum(m, m_s)
        old, new = tl.exp2(m - m_new), tl.exp2(m_s - m_new)
        total = total * old + acc_s * new
        denom = denom * old + l_s * new
        m = m_new
    row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    result = total / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dims * stride_od,
             result.to(out_ptr.dtype.element_ty), mask=dim_ok)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
           plan: AttentionLaunchPlan, sc: Scores, out: torch.Tensor, key_tile: int) -> None:
    """Attention of the plan's decode sequences, each context cut into `plan.num_splits` splits.

    Semantics: as kernels.attention_ref.paged_attention for the decode sequences' rows only.
    Shape: q, out [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D].
    """
    assert plan.split_len % key_tile == 0 and plan.split_len > 0, (plan.split_len, key_tile)
    num_q_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    n, splits = plan.num_decode, plan.num_splits
    acc, ml = _partials(batch, (n, num_q_heads, splits, head_dim) if splits > 1 else (1, 1, 1, 1), q.device)
    upcast = q.dtype == torch.float32 or not reads_exactly(k_cache.dtype, q.dtype) or _interpreting()
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_kernel[(n, num_kv_heads, splits)](
        q, k_cache, v_cache, out, acc, ml,
        batch.block_tables, batch.query_start_loc, batch.seq_lens, plan.decode,
        sc.qk_scale, sc.cap_in, sc.cap_out, sc.window, head_dim, block_size, plan.split_len, splits, num_q_heads,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *batch.block_tables.stride(),
        GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=key_tile, BLOCK_D=block_d,
        UPCAST=upcast, SOFTCAP=sc.softcap, num_warps=num_warps(q.dtype),
    )
    if splits > 1:
        _combine_splits_kernel[(n, num_q_heads)](
            acc, ml, out, batch.query_start_loc, batch.seq_lens, plan.decode,
            head_dim, plan.split_len, splits, num_q_heads, *out.stride(), BLOCK_D=block_d,
        )


def _partials(batch: AttentionBatch, shape: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split partials (float32), one pair per step: layers run one after another on one stream.
    Without splits they are never touched, but the kernel's pointer types must not change."""
    key = ("decode-partials", shape, device)
    if key not in batch.scratch:
        batch.scratch[key] = (torch.empty(shape, dtype=torch.float32, device=device),
                              torch.empty((*shape[:3], 2), dtype=torch.float32, device=device))
    return batch.scratch[key]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
