"""Int8 weight-only base projections: per-output-channel symmetric scales, float activations.

A weight row w[o, :] is stored as q[o, :] = round(w[o, :] / s[o]) in int8 with s[o] = max|w[o, :]| / 127,
so |w - q * s| <= s / 2 elementwise. Scales are per output row, so quantizing fused projections (qkv,
gate_up) equals quantizing each projection and concatenating: the fused layers need nothing special.

The matmul is torch's CPU int8 weight-only kernel, `aten._weight_int8pack_mm` (what torchao's
Int8WeightOnlyConfig and gpt-fast call). On torch 2.13's CPU build it takes float32, bfloat16 or
float16 activations with scales of the activations' own dtype, so scales are stored in the activation
dtype. Anything else (another device, a dtype it refuses) goes through the dequantized float matmul,
which is the same product up to the order of float accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QMAX = 127  # symmetric: -128 is never produced, so negation is exact
INT8PACK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Int8Weight:
    """A quantized [out, in] weight: w ~= qweight * scale[:, None]."""

    qweight: torch.Tensor  # [out, in] int8, contiguous
    scale: torch.Tensor  # [out], the activation dtype

    def __post_init__(self) -> None:
        assert self.qweight.dtype == torch.int8 and self.qweight.dim() == 2 and self.qweight.is_contiguous()
        assert self.scale.shape == (self.qweight.shape[0],)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        """Bytes this weight keeps on its device: the int8 matrix and its scales."""
        return self.qweight.nbytes + self.scale.nbytes


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype | None = None) -> Int8Weight:
    """Round-to-nearest symmetric int8 with one scale per output row.

    Semantics: s[o] = max|w[o, :]| / 127 computed in float32 (1 for an all-zero row, whose q is 0),
    q = clamp(round(w / s), -127, 127); scales are then stored in `scale_dtype` (default w's dtype).
    Shape: weight [out, in] float; returns qweight [out, in] int8, scale [out].
    """
    assert weight.dim() == 2 and weight.is_floating_point()
    w = weight.float()
    amax = w.abs().amax(dim=1)  # [out]
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))  # a zero row keeps q = 0 under any scale
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.to(scale_dtype or weight.dtype))


def dequantize_int8(weight: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Semantics: q * s in float32, then rounded to `dtype`. Shape: returns [out, in]."""
    return (weight.qweight.float() * weight.scale.float()[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The base projection on an int8 weight, F.linear's contract otherwise.

    Semantics: y = x @ (q * s[:, None]).T + bias; through `aten._weight_int8pack_mm` on a CPU for
    float32/bfloat16/float16 x (which multiplies by q and scales each output column by s), else
    through the dequantized weight. The two agree up to float accumulation order.
    Shape: x [T, in]; weight.qweight [out, in] int8, weight.scale [out]; bias [out] or None;
    out [T, out] in x's dtype or None; returns [T, out] (`out` itself when given).
    """
    if x.device.type == "cpu" and x.dtype in INT8PACK_DTYPES:
        scale = weight.scale if weight.scale.dtype == x.dtype else weight.scale.to(x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), weight.qweight, scale)  # [T, out]
        if bias is not None:
            y += bias
    else:
        y = F.linear(x, dequantize_int8(weight, x.dtype), bias)
    return y if out is None else out.copy_(y)
