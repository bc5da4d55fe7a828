"""The int8 weight-only projection for float32 activations on AVX2 + FMA CPUs: a small C++ kernel
(kernels/int8_avx2.cpp) compiled once with the system's C++ compiler and called through ctypes.

Why a kernel of our own: on an AVX2-only CPU torch has no fast int8 weight-only matmul for float32
activations (aten._weight_int8pack_mm is vectorized for AVX-512 only; inductor's int8 WOQ GEMM
template has AVX2 configurations for bfloat16 activations only), and dequantizing the whole weight
per call moves more bytes than the float32 matmul it replaces. This kernel widens each int8 weight
in registers and multiplies it with up to 8 token rows. Measured on the shared 2-vCPU AVX2 EPYC,
the 120 smol135 decoder projections at 8 token rows, 1 thread: 64 CPU ms against 148 for the
float32 matmul and 197 for dequant_linear, near the core's FMA bound (docs/benchmarks/int8-cpu.md).

Built and cached by kernels.cpp_kernel.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Callable

import torch

from kernels import cpp_kernel
from kernels.cpp_kernel import REQUIRED_FLAGS, KernelBuildError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_avx2.cpp")
ENTRY = "loraplex_int8_linear_f32"


def build_library(cache_dir: Path | None = None, compiler: str | None = None) -> Path:
    """The compiled kernel's path (kernels.cpp_kernel.build_library). Raises KernelBuildError."""
    return cpp_kernel.build_library(SOURCE, cache_dir, compiler)


def load_avx2_int8_linear(cache_dir: Path | None = None, compiler: str | None = None) -> Callable[..., torch.Tensor]:
    """avx2_int8_linear on the compiled kernel (built if need be). Raises KernelBuildError."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    kernel = cpp_kernel.load_entry(SOURCE, ENTRY, [p, i64, p, p, p, p, i64, i64, i64, i64, ctypes.c_int], cache_dir,
                                   compiler)

    def avx2_int8_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                         out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """The base projection on an Int8Weight (kernels.int8_weights), F.linear's contract.

        Semantics: y = (x @ q.T) * s + bias, each dot product accumulated in float32 FMAs over
        8-wide lanes; equals x @ (q * s).T up to the order of float accumulation. `scratch` is
        dequant_linear's, unused here. Raises ValueError on operands the kernel cannot take (it
        reads and writes through raw pointers, so every extent is checked, not asserted).
        Shape: x [T, in] float32 on the CPU; weight.qweight [out, in] int8 contiguous,
        weight.scale [out] float32; bias [out] float32 or None; out [T, out] float32 with unit
        column stride, or None; returns [T, out] (`out` itself when given).
        """
        q, scale = weight.qweight, weight.scale
        x = x.contiguous()
        n_tok, n_in = x.shape
        n_out = q.shape[0]
        if out is None:
            out = torch.empty(n_tok, n_out, dtype=torch.float32)
        if (x.dtype != torch.float32 or x.device.type != "cpu" or q.dtype != torch.int8 or not q.is_contiguous()
                or q.shape[1] != n_in or scale.dtype != torch.float32 or scale.shape != (n_out,)
                or not scale.is_contiguous() or out.dtype != torch.float32 or out.shape != (n_tok, n_out)
                or out.stride(1) != 1 or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (n_out,)
                                                                or not bias.is_contiguous()))):
            raise ValueError(f"avx2_int8_linear takes float32 x [T, in] and an int8 [out, in] weight with float32 "
                             f"scales: got x {tuple(x.shape)} {x.dtype}, weight {tuple(q.shape)} {q.dtype}, "
                             f"scale {scale.dtype}, out {tuple(out.shape)} {out.dtype}")
        kernel(x.data_ptr(), x.stride(0), q.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(),
               out.data_ptr(), out.stride(0), n_tok, n_out, n_in, torch.get_num_threads())
        return out

    return avx2_int8_linear


def avx2_int8_linear_or_none(flags: frozenset[str], cache_dir: Path | None = None,
                             compiler: str | None = None) -> Callable[..., torch.Tensor] | None:
    """The kernel where this CPU has AVX2 + FMA and it builds; else None, with a log line saying why."""
    if not REQUIRED_FLAGS <= flags:
        return None
    try:
        return load_avx2_int8_linear(cache_dir, compiler)
    except KernelBuildError as e:
        log.warning("int8: the AVX2 int8 matmul is unavailable (%s); dequantizing each weight per call instead, "
                    "slower than float32 at decode", e)
        return None
