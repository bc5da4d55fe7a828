"""Triton multi-LoRA on MoE experts, with the semantics of kernels.expert_lora_ref.expert_lora_apply.

Gathered (BGMV-shaped) across adapters and experts: one shrink program per routed pair, which reads its
own (expert, slot) A, and one expand program per (pair, column tile); pairs of slot -1 exit at once. One
launch of each serves every expert and adapter of the layer, with no host-side knowledge of the routing,
so a step's launches are sized by its pair count alone. The shrink keeps its product in float32 ([P, R]
scratch), rounded once when the expand adds onto y, as the reference does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.expert_batch import ExpertBatch

BLOCK_R = 16  # rank tile: the program's registers stay [16, 64] whatever max_lora_rank (512 too)
BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _pair(experts_ptr, slots_ptr):
    """(pair, its slot, its expert) of this program, as int64."""
    p = tl.program_id(0).to(tl.int64)
    return p, tl.load(slots_ptr + p).to(tl.int64), tl.load(experts_ptr + p).to(tl.int64)


@triton.jit(do_not_specialize=["R"])
def _expert_shrink_kernel(x_ptr, a_ptr, scaling_ptr, h_ptr, experts_ptr, slots_ptr, K, R,
                          stride_xp, stride_ae, stride_al, stride_ar, stride_se, stride_hp,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Semantics: program (p, rank tile) writes h[p, ranks] = scaling[e, s] * x[p] @ lora_a[e, s, ranks].T
    in float32 for its ranks below R, where e = experts[p], s = slots[p]; nothing for s < 0.
    Shape: grid (P, cdiv(buffer rank, BLOCK_R)), the tiles past R exiting; x [P, K] (unit stride along K);
    lora_a [E, L, >= R, K] (unit stride along K); scaling [E, L] float32 (unit stride along L); h [P, >= R]
    float32."""
    p, s, e = _pair(experts_ptr, slots_ptr)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    if s < 0 or tl.program_id(1) * BLOCK_R >= R:
        return
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_base = a_ptr + e * stride_ae + s * stride_al
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + p * stride_xp + k, mask=k < K, other=0.0).to(tl.float32)
        av = tl.load(a_base + r[:, None] * stride_ar + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K),
                     other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    scale = tl.load(scaling_ptr + e * stride_se + s)
    tl.store(h_ptr + p * stride_hp + r, acc * scale, mask=r < R)


@triton.jit(do_not_specialize=["R"])
def _expert_expand_kernel(h_ptr, b_ptr, y_ptr, experts_ptr, slots_ptr, N, R,
                          stride_hp, stride_be, stride_bl, stride_br, stride_yp,
                          BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Semantics: program (p, n-tile) adds h[p, :R] @ lora_b[e, s, :R, cols] onto y[p, cols], summed in
    float32 over rank tiles in order and rounded once to y's dtype; nothing for s < 0.
    Shape: grid (P, cdiv(N, BLOCK_N)); h [P, >= R] float32; lora_b [E, L, >= R, N] (unit stride along N);
    y [P, N] (unit stride along N)."""
    p, s, e = _pair(experts_ptr, slots_ptr)
    if s < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_base = b_ptr + e * stride_be + s * stride_bl
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        hv = tl.load(h_ptr + p * stride_hp + r, mask=r < R, other=0.0)
        bv = tl.load(b_base + r[:, None] * stride_br + n[None, :], mask=(r[:, None] < R) & (n[None, :] < N),
                     other=0.0).to(tl.float32)
        acc += tl.sum(hv[:, None] * bv, axis=0)
    yp = y_ptr + p * stride_yp + n
    yv = tl.load(yp, mask=n < N, other=0.0).to(tl.float32)
    tl.store(yp, (yv + acc).to(y_ptr.dtype.element_ty), mask=n < N)


def expert_lora_apply(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
                      batch: ExpertBatch, y: torch.Tensor) -> None:
    """kernels.expert_lora_ref.expert_lora_apply, in two launches over every pair."""
    pairs, k = x.shape
    n = y.shape[1]
    buffer_rank = lora_a.shape[2]
    r = batch.effective_rank(buffer_rank)
    if pairs == 0 or r == 0:
        return
    assert x.stride(1) == 1 and lora_a.stride(3) == 1 and lora_b.stride(3) == 1 and y.stride(1) == 1
    assert scaling.stride(1) == 1, "scalings slot-contiguous per expert"
    # At the buffers' rank, not the step's: every stride and grid bound is fixed per engine (one variant each).
    h = torch.empty(pairs, buffer_rank, dtype=torch.float32, device=x.device)
    _expert_shrink_kernel[(pairs, triton.cdiv(buffer_rank, BLOCK_R))](
        x, lora_a, scaling, h, batch.experts, batch.slots, k, r, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        lora_a.stride(2), scaling.stride(0), h.stride(0), BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    _expert_expand_kernel[(pairs, triton.cdiv(n, BLOCK_N))](
        h, lora_b, y, batch.experts, batch.slots, n, r, h.stride(0), lora_b.stride(0), lora_b.stride(1),
        lora_b.stride(2), y.stride(0), BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N)
