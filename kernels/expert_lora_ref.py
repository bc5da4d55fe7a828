"""Multi-LoRA on MoE experts in plain torch: the semantics kernels.expert_lora_triton implements, and the
CPU engine's path (one shrink and one expand matmul per (expert, adapter slot) group of the step).

PEFT's `target_parameters` LoRA on a fused expert weight [E, out, in] (peft ParamWrapper) gives expert
e the delta scaling * B_e @ A_e; the slot buffers hold each expert's A_e and B_e^T at the maximum rank,
rows past an adapter's own rank zero, as the dense slots do (kernels.lora_ref).
"""
from __future__ import annotations

import torch

from kernels.expert_batch import ExpertBatch


def expert_lora_apply(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
                      batch: ExpertBatch, y: torch.Tensor) -> None:
    """Add each pair's expert LoRA delta onto the pair's base expert output.

    Semantics: for pair p with s = batch.slots[p] >= 0 and e = batch.experts[p], R' = batch.effective_rank(R):
        y[p] += scaling[e, s] * (x[p] @ lora_a[e, s, :R'].T) @ lora_b[e, s, :R']
    computed in float32 and rounded once to y's dtype. Pairs of slot -1 are left bit-identical.
    Shape: x [P, in]; lora_a [E, L, R, in]; lora_b [E, L, R, out] (B^T, rank-major); scaling [E, L]
        float32; y [P, out], modified in place.
    """
    r = batch.effective_rank(lora_a.shape[2])
    for start, n, e, s in batch.groups:
        rows = slice(start, start + n)
        h = x[rows].float() @ lora_a[e, s, :r].float().t() * scaling[e, s]  # [n, r]
        y[rows] = (y[rows].float() + h @ lora_b[e, s, :r].float()).to(y.dtype)
