"""fp8 (e4m3) base projections for Hopper/Ada: per-output-channel weight scales, per-token activation
scales computed on the fly, one `torch._scaled_mm` per projection (w8a8, vLLM's dynamic fp8 scheme).

A weight row w[o, :] is stored as q[o, :] = fp8(w[o, :] / s[o]) with s[o] = max|w[o, :]| / 448 (e4m3's
largest finite value), so each row uses the format's whole range. Scales are per output row, so
quantizing fused projections (qkv, gate_up) equals quantizing each and concatenating. At run time each
token's activations get their own scale a[t] = max|x[t, :]| / 448 and
    y[t, o] = a[t] * s[o] * sum_i fp8(x[t, i] / a[t]) * q[o, i]
which `_scaled_mm` computes with both scale vectors in its epilogue (row-wise scaling). The tensor cores
run e4m3 products from compute capability 8.9 (Ada, Hopper); elsewhere the engine refuses fp8
(server.engine.config). torch's CPU build has `_scaled_mm` too, which is how the tests run this
exact call without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# _scaled_mm needs the reduction and output dimensions in multiples of 16 on CUDA.
FP8_ALIGN = 16


@dataclass(frozen=True)
class Fp8Weight:
    """A quantized [out, in] weight: w ~= qweight.float() * scale[:, None]."""

    qweight: torch.Tensor  # [out, in] float8_e4m3fn, contiguous (its .t() is the column-major mat2)
    scale: torch.Tensor  # [out] float32

    def __post_init__(self) -> None:
        assert self.qweight.dtype == FP8 and self.qweight.dim() == 2 and self.qweight.is_contiguous()
        assert self.scale.shape == (self.qweight.shape[0],) and self.scale.dtype == torch.float32

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scale.nbytes


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """Round-to-nearest e4m3 with one float32 scale per output row.

    Semantics: s[o] = max|w[o, :]| / 448 in float32 (1 for an all-zero row), q = fp8(clamp(w / s, -448, 448)).
    Shape: weight [out, in] float, both multiples of FP8_ALIGN; returns qweight [out, in], scale [out].
    """
    assert weight.dim() == 2 and weight.is_floating_point()
    if weight.shape[0] % FP8_ALIGN or weight.shape[1] % FP8_ALIGN:
        raise ValueError(f"fp8 projections need both dimensions in multiples of {FP8_ALIGN}, got {tuple(weight.shape)}")
    w = weight.float()
    amax = w.abs().amax(dim=1)  # [out]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q.contiguous(), scale)


def dequantize_fp8(weight: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Semantics: q * s in float32, then rounded to `dtype`. Shape: returns [out, in]."""
    return (weight.qweight.float() * weight.scale[:, None]).to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic scales: a[t] = max|x[t, :]| / 448 (1 for a zero row), xq = fp8(x / a).
    Shape: x [T, in]; returns xq [T, in] float8_e4m3fn, a [T, 1] float32."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)  # [T, 1]
    a = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / a).clamp_(-FP8_MAX, FP8_MAX).to(FP8), a


def scaled_mm_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The base projection on an fp8 weight, F.linear's contract, through one `torch._scaled_mm`.

    Semantics: y[t, o] = a[t] * s[o] * (fp8(x[t] / a[t]) . q[o]) + bias[o], accumulated in float32 and
    rounded once to x's dtype (a: quantize_activations' per-token scales).
    Shape: x [T, in] (bfloat16 on CUDA, where row-wise scaling needs it; any float dtype on CPU);
    weight.qweight [out, in], weight.scale [out]; bias [out] or None; out [T, out] in x's dtype or None;
    returns [T, out] (`out` itself when given).
    """
    xq, a = quantize_activations(x)  # [T, in], [T, 1]
    y = torch._scaled_mm(xq, weight.qweight.t(), scale_a=a, scale_b=weight.scale[None, :],
                         out_dtype=x.dtype)  # [T, out]
    if bias is not None:
        y += bias
    return y if out is None else out.copy_(y)


def fp8_linear_ref(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """scaled_mm_linear's semantics in plain float32 torch (the tests' oracle).
    Shape: as scaled_mm_linear; returns [T, out] float32."""
    xq, a = quantize_activations(x)
    y = (xq.float() * a) @ dequantize_fp8(weight).t()  # [T, out]
    return y if bias is None else y + bias.float()
