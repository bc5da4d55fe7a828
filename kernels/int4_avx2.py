"""The int4 weight-only projection for float32 activations on AVX2 + FMA CPUs: a small C++ kernel
(kernels/int4_avx2.cpp) compiled once with the system's C++ compiler (kernels.cpp_kernel) and called
through ctypes.

Why a kernel of our own: torch's CPU int4 matmul (aten._weight_int4pack_mm_for_cpu) is vectorized for
half-precision activations only (float32 ones: 40x the float32 matmul here), and dequantizing the whole
weight per call moves more bytes than the float32 matmul it replaces. This kernel widens 16 nibbles at
a time in registers, scales them and multiplies them with up to 8 token rows; each group's offset is
applied once per group, from the activations' per-group sums, which the kernel computes once per call
(with the activations' channels reordered to match the packing: the .cpp says why). Past
DEQUANT_ROWS token rows (a prefill) the float32 GEMM wins even with the weight's unpacking on top, so
the kernel instead unpacks the weight once into the workspace's scratch and torch.mm runs on it:
measured on the AVX2 EPYC, the smol135 projections at 32 rows took 389 CPU ms through the row kernel
against 274 for float32 (docs/benchmarks/int4-cpu.md).
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from kernels import cpp_kernel
from kernels.cpp_kernel import REQUIRED_FLAGS, KernelBuildError

if TYPE_CHECKING:  # kernels.int4_weights chooses this kernel, so it imports this module
    from kernels.int4_weights import Int4Weight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_avx2.cpp")
ENTRY = "loraplex_int4_linear_f32"
DEQUANT_ENTRY = "loraplex_int4_dequant_f32"
DEQUANT_ROWS = 16  # more token rows than this: unpack once, then the float32 GEMM


def load_avx2_int4_linear(cache_dir: Path | None = None, compiler: str | None = None) -> Callable[..., torch.Tensor]:
    """avx2_int4_linear on the compiled kernel (built if need be). Raises KernelBuildError."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    kernel = cpp_kernel.load_entry(SOURCE, ENTRY, [p, i64, p, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_int],
                                   cache_dir, compiler)
    dequant = cpp_kernel.load_entry(SOURCE, DEQUANT_ENTRY, [p, p, p, p, i64, i64, i64, i64, ctypes.c_int], cache_dir,
                                    compiler)

    def avx2_int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None,
                         out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """The base projection on an Int4Weight (kernels.int4_weights), F.linear's contract.

        Semantics: y = x @ w.T + bias, w = s * q + m (kernels.int4_weights), computed per group g as
        sum_k x (s q) + m sum_k x in float32 FMAs over 8-wide lanes: equals dequant_int4_linear up
        to the order and grouping of float accumulation. Past DEQUANT_ROWS rows: w unpacked into
        `scratch` (a flat float32 buffer of at least out * in elements, reused across calls; None:
        allocated), then x @ w.T by torch. Raises ValueError on operands the kernel cannot
        take (it reads and writes through raw pointers, so every extent is checked, not asserted).
        Shape: x [T, in] float32 on the CPU, in % 16 == 0; weight.qweight [out, in / 2] uint8, weight.scale and
        weight.offset [out, G]; bias [out] float32 or None; out [T, out] float32 with unit column
        stride, or None; returns [T, out] (`out` itself when given).
        """
        q, scale, offset = weight.qweight, weight.scale, weight.offset
        x = x.contiguous()
        n_tok, n_in = x.shape
        n_out, groups = scale.shape
        if out is None:
            out = torch.empty(n_tok, n_out, dtype=torch.float32)
        if (x.dtype != torch.float32 or x.device.type != "cpu" or q.device.type != "cpu" or q.dtype != torch.uint8
                or not q.is_contiguous() or q.shape != (n_out, n_in // 2) or n_in % 16
                or groups != -(-n_in // weight.group_size) or weight.group_size % 8
                or scale.dtype != torch.float32 or not scale.is_contiguous() or offset.dtype != torch.float32
                or offset.shape != (n_out, groups) or not offset.is_contiguous()
                or out.dtype != torch.float32 or out.shape != (n_tok, n_out) or out.stride(1) != 1
                or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (n_out,)
                                          or not bias.is_contiguous()))):
            raise ValueError(f"avx2_int4_linear takes float32 x [T, in] and an int4 [out, in] weight: got x "
                             f"{tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} in {groups} groups of "
                             f"{weight.group_size}, out {tuple(out.shape)} {out.dtype}")
        if n_tok > DEQUANT_ROWS:
            if scratch is None:
                scratch = torch.empty(n_out * n_in, dtype=torch.float32)
            assert scratch.dtype == torch.float32 and scratch.numel() >= n_out * n_in and scratch.is_contiguous()
            w = scratch[: n_out * n_in].view(n_out, n_in)
            dequant(q.data_ptr(), scale.data_ptr(), offset.data_ptr(), w.data_ptr(), n_out, n_in, weight.group_size,
                    groups, torch.get_num_threads())
            torch.mm(x, w.t(), out=out)
            return out if bias is None else out.add_(bias)
        kernel(x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(), offset.data_ptr(),
               None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), n_tok, n_out, n_in,
               weight.group_size, groups, torch.get_num_threads())
        return out

    return avx2_int4_linear


def avx2_int4_linear_or_none(flags: frozenset[str], cache_dir: Path | None = None,
                             compiler: str | None = None) -> Callable[..., torch.Tensor] | None:
    """The kernel where this CPU has AVX2 + FMA and it builds; else None, with a log line saying why."""
    if not REQUIRED_FLAGS <= flags:
        return None
    try:
        return load_avx2_int4_linear(cache_dir, compiler)
    except KernelBuildError as e:
        log.warning("int4: the AVX2 int4 matmul is unavailable (%s); dequantizing each weight per call instead, "
                    "slower than float32", e)
        return None
