"""Int4 weight-only base projections: groups of input channels share a scale and an offset
(asymmetric), activations stay float.

A weight row w[o, :] is cut into groups of `group_size` input channels (the last one may be short);
group g of row o stores q[o, i] in 0..15 with one scale s[o, g] and one offset m[o, g], and

    w[o, i] = s[o, g] * q[o, i] + m[o, g],   g = i // group_size,

in float32: GGUF's Q4_1 arithmetic. It holds GPTQ's w = s * (q - z) exactly with m = -s * z (a
float16 scale times an integer below 17 is exact in float32, and so is the sum, whose exact value
s * (q - z) fits float32: server.engine.gptq_checkpoint), and round-to-nearest over each group's own
[min, max] (quantize_int4), with no range forced to hold 0 and no zero rounded to an integer: a model
whose weights came from Q4_1 blocks of 32 (the default model's GGUF) is reproduced by groups of 32.
Two 4-bit values share a byte: input channel 2j of a row in its low nibble, 2j + 1 in its high one,
so a row's bytes read as little-endian int32 words are GPTQ's own packing along the input dimension.

Scales and offsets are per output row, so fused projections (qkv, gate_up) are their parts' rows
concatenated (cat_int4). A weight reads 0.5 bytes per value plus 8 bytes per group of a row: at group
size 32 (the default), 0.188x float32 (0.375x bfloat16); at 128, 0.141x.

Matmuls (the kernel sets' int4_linear): kernels.int4_avx2 on AVX2 + FMA CPUs for float32 activations
(widens each nibble in registers: a decode step reads half a byte per weight), kernels.int4_triton on
GPUs, and dequant_int4_linear (a float copy of the weight per call, then the float matmul) everywhere
else. All equal x @ dequantize_int4(w).T up to the order of float accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.cpu_linear import cpu_flags
from kernels.int4_avx2 import avx2_int4_linear_or_none
# The group rule has no torch in it (server.engine.config checks it); importable from here as before.
from kernels.int4_groups import DEFAULT_GROUP_SIZE, GROUP_MULTIPLE, check_group_size  # noqa: F401

QMAX = 15  # 4 bits, unsigned


@dataclass(frozen=True)
class Int4Weight:
    """A quantized [out, in] weight: w[o, i] = scale[o, g] * q[o, i] + offset[o, g], g = i // group_size."""

    qweight: torch.Tensor  # [out, in / 2] uint8: channel 2j in the low nibble of byte j, 2j + 1 in the high one
    scale: torch.Tensor  # [out, G] float32, G = ceil(in / group_size)
    offset: torch.Tensor  # [out, G] float32: the value of q = 0
    group_size: int

    def __post_init__(self) -> None:
        out, half = self.qweight.shape
        groups = -(-2 * half // self.group_size)
        assert self.qweight.dtype == torch.uint8 and self.qweight.is_contiguous()
        assert self.group_size > 0 and self.group_size % GROUP_MULTIPLE == 0
        assert self.scale.dtype == torch.float32 and self.scale.shape == (out, groups) and self.scale.is_contiguous()
        assert self.offset.dtype == torch.float32 and self.offset.shape == (out, groups) and self.offset.is_contiguous()

    @property
    def shape(self) -> torch.Size:
        """The float weight's [out, in]."""
        return torch.Size((self.qweight.shape[0], 2 * self.qweight.shape[1]))

    @property
    def nbytes(self) -> int:
        """Bytes this weight keeps on its device: the packed values, scales and offsets."""
        return self.qweight.nbytes + self.scale.nbytes + self.offset.nbytes


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Semantics: byte j of a row = q[2j] | q[2j + 1] << 4. Shape: q [out, in] integer in 0..15, in even;
    returns [out, in / 2] uint8, contiguous."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse. Shape: packed [out, in / 2] uint8; returns [out, in] uint8."""
    return torch.stack([packed & 0xF, packed >> 4], dim=2).flatten(1, 2)


def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Weight:
    """Round-to-nearest asymmetric int4 over each group's own range (Q4_1's quantizer).

    Semantics: per (row, group), lo = min w and hi = max w over the group's channels, in float32;
    s = (hi - lo) / 15 (1 for a constant group, whose q is then 0 and whose value is lo exactly),
    m = lo, q = clamp(round((w - lo) / s), 0, 15). |w - (s q + m)| <= s / 2 up to float rounding.
    Shape: weight [out, in] float; returns an Int4Weight of G = ceil(in / group_size) groups.
    """
    assert weight.dim() == 2 and weight.is_floating_point()
    n_out, n_in = weight.shape
    check_group_size(group_size, n_in)
    groups = -(-n_in // group_size)
    pad = groups * group_size - n_in  # the last group's missing channels: outside every min and max
    w = weight.float()
    lo = torch.nn.functional.pad(w, (0, pad), value=float("inf")).view(n_out, groups, group_size).amin(dim=2)
    hi = torch.nn.functional.pad(w, (0, pad), value=float("-inf")).view(n_out, groups, group_size).amax(dim=2)
    scale = torch.where(hi > lo, (hi - lo) / QMAX, torch.ones_like(lo))  # [out, G]
    g = torch.arange(n_in, device=w.device) // group_size  # [in]
    q = torch.round((w - lo[:, g]) / scale[:, g]).clamp(0, QMAX)  # [out, in]
    return Int4Weight(pack_nibbles(q), scale.contiguous(), lo.contiguous(), group_size)


def dequantize_int4(weight: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Semantics: s * q + m in float32 (a product, then a sum: two roundings), then rounded to `dtype`.
    Shape: returns [out, in]."""
    n_out, n_in = weight.shape
    g = torch.arange(n_in, device=weight.qweight.device) // weight.group_size  # [in]
    q = unpack_nibbles(weight.qweight).float()  # [out, in]
    return (weight.scale[:, g] * q + weight.offset[:, g]).to(dtype)


def rows_int4(weight: Int4Weight, idx: torch.Tensor) -> torch.Tensor:
    """The dequantized rows idx, float32. Shape: idx [n] int64; returns [n, in]."""
    part = Int4Weight(weight.qweight.index_select(0, idx).contiguous(), weight.scale.index_select(0, idx).contiguous(),
                      weight.offset.index_select(0, idx).contiguous(), weight.group_size)
    return dequantize_int4(part)


def cat_int4(parts: list[Int4Weight]) -> Int4Weight:
    """The fused projection: the parts' rows one after another (they must share in and group_size)."""
    assert len({(p.shape[1], p.group_size) for p in parts}) == 1, "fused parts share their inputs and groups"
    return Int4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.offset for p in parts]), parts[0].group_size)


def int4_to(weight: Int4Weight, device: torch.device) -> Int4Weight:
    return Int4Weight(weight.qweight.to(device), weight.scale.to(device), weight.offset.to(device), weight.group_size)


def dequant_int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The base projection on an int4 weight through a float copy of it, F.linear's contract.

    Semantics: y = x @ dequantize_int4(w, x.dtype).T + bias: each weight is s * q + m in float32
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
