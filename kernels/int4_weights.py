"""Int4 weight-only base projections: groups of input channels share a scale and a zero point
(asymmetric, GPTQ's arithmetic), activations stay float.

A weight row w[o, :] is cut into groups of `group_size` input channels (the last one may be short);
group g of row o stores q[o, i] in 0..15 with one scale s[o, g] and one integer zero z[o, g], and

    w[o, i] = s[o, g] * (q[o, i] - z[o, g]),   g = i // group_size,

computed in float32. That is the value a GPTQ checkpoint means (server.engine.gptq_checkpoint
dequantizes it the same way, so the PEFT oracle on the dequantized weights is exact), and what
round-to-nearest quantization of a float checkpoint stores (quantize_int4). Two 4-bit values share a
byte: input channel 2j of a row in its low nibble, 2j + 1 in its high one, so a row's bytes read as
little-endian int32 words are GPTQ's own packing along the input dimension.

Scales and zeros are per output row, so fused projections (qkv, gate_up) are their parts' rows
concatenated (cat_int4). A weight reads 0.5 bytes per value plus 5 bytes per group of a row: at group
size 128, 0.127x float32 (0.254x bfloat16).

Matmuls (the kernel sets' int4_linear): kernels.int4_avx2 on AVX2 + FMA CPUs for float32 activations
(widens each nibble in registers: a decode step reads half a byte per weight), kernels.int4_triton on
GPUs, and dequant_int4_linear (a float copy of the weight in a reused scratch, then the float matmul)
everywhere else. All equal x @ dequantize_int4(w).T up to the order of float accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.cpu_linear import cpu_flags
from kernels.int4_avx2 import avx2_int4_linear_or_none

QMAX = 15  # 4 bits, unsigned
DEFAULT_GROUP_SIZE = 128  # GPTQ's and AWQ's usual group
# A group is whole 8-value words in the kernels (kernels.int4_avx2 unpacks 8 nibbles at a time), and the
# Triton kernel's K tile (a power of two >= 8) must lie within one group: group sizes are multiples of 32.
GROUP_MULTIPLE = 32


@dataclass(frozen=True)
class Int4Weight:
    """A quantized [out, in] weight: w[o, i] = scale[o, g] * (q[o, i] - zero[o, g]), g = i // group_size."""

    qweight: torch.Tensor  # [out, in / 2] uint8: channel 2j in the low nibble of byte j, 2j + 1 in the high one
    scale: torch.Tensor  # [out, G] float32, G = ceil(in / group_size)
    zero: torch.Tensor  # [out, G] uint8, 0..16 (a GPTQ checkpoint's stored zero + 1 can be 16)
    group_size: int

    def __post_init__(self) -> None:
        out, half = self.qweight.shape
        groups = -(-2 * half // self.group_size)
        assert self.qweight.dtype == torch.uint8 and self.qweight.is_contiguous()
        assert self.group_size > 0 and self.group_size % GROUP_MULTIPLE == 0
        assert self.scale.dtype == torch.float32 and self.scale.shape == (out, groups) and self.scale.is_contiguous()
        assert self.zero.dtype == torch.uint8 and self.zero.shape == (out, groups) and self.zero.is_contiguous()

    @property
    def shape(self) -> torch.Size:
        """The float weight's [out, in]."""
        return torch.Size((self.qweight.shape[0], 2 * self.qweight.shape[1]))

    @property
    def nbytes(self) -> int:
        """Bytes this weight keeps on its device: the packed values, scales and zeros."""
        return self.qweight.nbytes + self.scale.nbytes + self.zero.nbytes


def check_group_size(group_size: int, n_in: int) -> None:
    """Raises ValueError naming the rule when `group_size` cannot serve a projection of n_in inputs."""
    if n_in % 16:  # two per byte, and the CPU kernel widens 16 at a time (every real model's widths are)
        raise ValueError(f"int4 needs input widths that are multiples of 16, got {n_in}")
    if group_size <= 0 or group_size % GROUP_MULTIPLE:
        raise ValueError(f"int4 group size must be a positive multiple of {GROUP_MULTIPLE}, got {group_size}")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Semantics: byte j of a row = q[2j] | q[2j + 1] << 4. Shape: q [out, in] integer in 0..15, in even;
    returns [out, in / 2] uint8, contiguous."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse. Shape: packed [out, in / 2] uint8; returns [out, in] uint8."""
    return torch.stack([packed & 0xF, packed >> 4], dim=2).flatten(1, 2)


def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Weight:
    """Round-to-nearest asymmetric int4 per group of input channels, GPTQ's quantizer without its
    error feedback.

    Semantics: per (row, group), lo = min(min w, 0) and hi = max(max w, 0) in float32 (the range holds
    0, so a zero weight stays exact); s = (hi - lo) / 15 (1 for an all-zero group), z = round(-lo / s),
    q = clamp(round(w / s) + z, 0, 15). |w - s (q - z)| <= s / 2 wherever w lies in the range.
    Shape: weight [out, in] float; returns an Int4Weight of G = ceil(in / group_size) groups.
    """
    assert weight.dim() == 2 and weight.is_floating_point()
    n_out, n_in = weight.shape
    check_group_size(group_size, n_in)
    groups = -(-n_in // group_size)
    w = torch.nn.functional.pad(weight.float(), (0, groups * group_size - n_in))  # [out, G * gs], zeros pad
    w = w.view(n_out, groups, group_size)
    lo = w.amin(dim=2).clamp(max=0)  # [out, G]
    hi = w.amax(dim=2).clamp(min=0)
    scale = torch.where(hi > lo, (hi - lo) / QMAX, torch.ones_like(lo))
    zero = torch.round(-lo / scale).clamp(0, QMAX)
    q = (torch.round(w / scale[:, :, None]) + zero[:, :, None]).clamp(0, QMAX)  # [out, G, gs]
    q = q.view(n_out, -1)[:, :n_in]
    return Int4Weight(pack_nibbles(q), scale.contiguous(), zero.to(torch.uint8).contiguous(), group_size)


def dequantize_int4(weight: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Semantics: s * (q - z) in float32, then rounded to `dtype`. Shape: returns [out, in]."""
    n_out, n_in = weight.shape
    g = torch.arange(n_in, device=weight.qweight.device) // weight.group_size  # [in]
    q = unpack_nibbles(weight.qweight).float()  # [out, in]
    return (weight.scale[:, g] * (q - weight.zero[:, g].float())).to(dtype)


def rows_int4(weight: Int4Weight, idx: torch.Tensor) -> torch.Tensor:
    """The dequantized rows idx, float32. Shape: idx [n] int64; returns [n, in]."""
    part = Int4Weight(weight.qweight.index_select(0, idx).contiguous(), weight.scale.index_select(0, idx).contiguous(),
                      weight.zero.index_select(0, idx).contiguous(), weight.group_size)
    return dequantize_int4(part)


def cat_int4(parts: list[Int4Weight]) -> Int4Weight:
    """The fused projection: the parts' rows one after another (they must share in and group_size)."""
    assert len({(p.shape[1], p.group_size) for p in parts}) == 1, "fused parts share their inputs and groups"
    return Int4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.zero for p in parts]), parts[0].group_size)


def int4_to(weight: Int4Weight, device: torch.device) -> Int4Weight:
    return Int4Weight(weight.qweight.to(device), weight.scale.to(device), weight.zero.to(device), weight.group_size)


def dequant_int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The base projection on an int4 weight through a float copy of it, F.linear's contract.

    Semantics: y = x @ dequantize_int4(w, x.dtype).T + bias: each weight is s * (q - z) in float32
    rounded to x's dtype, as the oracle's dequantized checkpoint.
    Shape: x [T, in]; bias [out] or None; out [T, out] in x's dtype or None; returns [T, out] (`out`
    itself when given). `scratch` is unused (the int8 matmuls' signature): the unpacking allocates.
    """
    deq = dequantize_int4(weight, x.dtype)  # [out, in]
    y = torch.mm(x, deq.t(), out=out) if out is not None else torch.mm(x, deq.t())  # [T, out]
    if bias is not None:
        y += bias
    return y


def int4_linear_for(device: torch.device, dtype: torch.dtype = torch.float32, flags: frozenset[str] | None = None,
                    compiler: str | None = None) -> Callable[..., torch.Tensor]:
    """For float32 activations on an AVX2 + FMA CPU, kernels.int4_avx2's kernel (built now, or found
    built) unless it cannot be built; else dequant_int4_linear (the GPU's is the Triton kernel set's).
    compiler: the C++ compiler that builds the AVX2 kernel (default $CXX, else g++)."""
    if device.type != "cpu" or dtype != torch.float32:
        return dequant_int4_linear
    flags = cpu_flags() if flags is None else flags
    return avx2_int4_linear_or_none(flags, compiler=compiler) or dequant_int4_linear
