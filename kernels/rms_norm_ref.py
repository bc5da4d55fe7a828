"""RMSNorm and the residual add before it in torch: the CPU path's ops and kernels.rms_norm_triton's reference.

Semantics (Llama, plus_one False): out = weight * (h * rsqrt(mean(h^2) + eps)).to(x.dtype), h = x.float(),
the same order of operations as transformers' LlamaRMSNorm, so float32 matches it bit for bit.
Gemma (plus_one True): weight is the gain 1 + w, precomputed in float32, applied before the cast back:
out = (h * rsqrt(mean(h^2) + eps) * weight).to(x.dtype).
add_rms_norm: residual += x (rounded to the activation dtype), then out = rms_norm(residual).
Shape: x, residual [T, H]; weight [H]; out [T, H].
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if plus_one:
        return (h * weight).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 plus_one: bool = False) -> torch.Tensor:
    """residual += x in place; returns rms_norm(residual)."""
    residual += x
    return rms_norm(residual, weight, eps, plus_one)
