"""Int8 weight-only base projections: per-output-channel symmetric scales, float activations.

A weight row w[o, :] is stored as q[o, :] = round(w[o, :] / s[o]) in int8 with s[o] = max|w[o, :]| / 127,
so |w - q * s| <= s / 2 elementwise. Scales are per output row, so quantizing fused projections (qkv,
gate_up) equals quantizing each projection and concatenating: the fused layers need nothing special.

Three matmuls, chosen by measurement per CPU (int8_linear_for):
- kernels.int8_avx2, a C++ kernel built at start-up, for float32 activations on AVX2 + FMA CPUs
  without AVX-512: it widens the int8 weight in registers, so a decode step reads 1 byte per
  weight; 2.2x faster than the float32 matmul on the 120 smol135 projections at 8 token rows.
- `aten._weight_int8pack_mm`, torch's CPU int8 weight-only kernel (what torchao's Int8WeightOnlyConfig
  and gpt-fast call). On torch 2.13's CPU build it takes float32, bfloat16 or float16 activations with
  scales of the activations' own dtype (so scales are stored in the activation dtype). Its kernel is
  vectorized for AVX-512 (and NEON); on an AVX2-only EPYC it took 16-69 ms for 8 rows of the smol135
  projections against 1.1-8.1 ms for the float32 matmul (1 thread): 9-15x slower.
- dequantize into a reused float scratch, then the float matmul, then scale the output columns:
  1.1-1.6x the float32 matmul there. The fallback elsewhere: half-precision activations without
  AVX-512, no AVX2, or no C++ compiler to build kernels.int8_avx2 (ARM untested).
Both equal x @ (q * s).T up to the order of float accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.cpu_linear import cpu_flags
from kernels.int8_avx2 import avx2_int8_linear_or_none

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


def int8pack_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The base projection on an int8 weight through `aten._weight_int8pack_mm`, F.linear's contract.

    Semantics: y = (x @ q.T) * s + bias, accumulated by the kernel; x off the CPU or in a dtype the
    kernel refuses goes to dequant_linear. `scratch` is dequant_linear's, unused here.
    Shape: x [T, in]; weight.qweight [out, in] int8, weight.scale [out]; bias [out] or None;
    out [T, out] in x's dtype or None; returns [T, out] (`out` itself when given).
    """
    if x.device.type != "cpu" or x.dtype not in INT8PACK_DTYPES or not _int8pack_takes(x):
        return dequant_linear(x, weight, bias, out, scratch)
    scale = weight.scale if weight.scale.dtype == x.dtype else weight.scale.to(x.dtype)
    y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), weight.qweight, scale)  # [T, out]
    if bias is not None:
        y += bias
    return y if out is None else out.copy_(y)


def _int8pack_takes(x: torch.Tensor) -> bool:
    """Whether aten._weight_int8pack_mm computes this x right. torch 2.13's bfloat16 path on CPUs with
    AVX512-BF16 (Sapphire Rapids) reads past a row whose features are not a multiple of 16: garbage
    (in=72) or a segfault (in=8, 200). float32 and float16 are right at every width."""
    return x.dtype is not torch.bfloat16 or x.shape[-1] % 16 == 0


def dequant_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The base projection on an int8 weight through a float copy of q, F.linear's contract.

    Semantics: y = (x @ float(q).T) * s + bias in x's dtype: q is exact in any float dtype, so this
    rounds like a float matmul on q followed by one scaling.
    Shape: x [T, in]; weight.qweight [out, in] int8, weight.scale [out]; bias [out] or None;
    out [T, out] in x's dtype or None; scratch: a flat buffer of x's dtype with at least out * in
    elements, reused across calls (a fresh 7 MB copy per call costs page faults), or None to
    allocate; returns [T, out] (`out` itself when given).
    """
    n_out, n_in = weight.shape
    if scratch is None:
        deq = weight.qweight.to(x.dtype)  # [out, in]
    else:
        assert scratch.dtype == x.dtype and scratch.numel() >= n_out * n_in
        deq = scratch[: n_out * n_in].view(n_out, n_in).copy_(weight.qweight)
    y = torch.mm(x, deq.t(), out=out) if out is not None else torch.mm(x, deq.t())  # [T, out]
    y.mul_(weight.scale.to(y.dtype))
    if bias is not None:
        y += bias
    return y


def int8_linear_for(device: torch.device, dtype: torch.dtype = torch.float32, flags: frozenset[str] | None = None,
                    compiler: str | None = None) -> Callable[..., torch.Tensor]:
    """int8pack_linear on a CPU with AVX-512 (where torch's int8 kernel is vectorized); for float32
    activations on AVX2 + FMA, kernels.int8_avx2's kernel (built now, or found built) unless it
    cannot be built; else dequant_linear (measured: module docstring). compiler: the C++ compiler
    that builds the AVX2 kernel (default $CXX, else g++)."""
    if device.type != "cpu":
        return dequant_linear
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        return int8pack_linear
    avx2 = avx2_int8_linear_or_none(flags, compiler=compiler) if dtype == torch.float32 else None
    return avx2 or dequant_linear
