"""The base projections' matmul on CPUs without half-precision dot products.

bfloat16 (and float16) matmuls run fast on a CPU only with the instructions for them (AVX-512
BF16 or AMX for bf16, AVX-512 FP16 or AMX-FP16 for fp16). Without them oneDNN/MKL fall back to
a path that, on an AVX2 EPYC, took 9.9 ms for a [32, 576] x [576, 3072] bf16 linear against 3.8
in float32, and 146 ms against 17.6 at 512 rows (2 threads). There the weights stay in half
precision (half the memory) and each linear upcasts its operands and computes in float32: 8.2
and 24.0 ms. That is the math the fast paths do anyway (half-precision inputs, float32
accumulation, one rounding of the output), so results agree with native half-precision matmuls
to within their rounding.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

# The cpuinfo flags that give each dtype a native matmul.
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags; empty where /proc/cpuinfo is missing (not Linux)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, written into `out` when given (the model's preallocated workspace).

    Semantics: y = x @ weight.T + bias, through the same addmm / mm that F.linear calls for 2-D
    inputs, so the result is bit for bit F.linear's.
    Shape: x [T, in]; weight [out, in]; bias [out] or None; out [T, out] contiguous or None;
    returns [T, out] (`out` itself when given).
    """
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear computed in float32 from half-precision operands, rounded once to x's dtype.

    Semantics: y = round_to(x.dtype)(float(x) @ float(weight).T + float(bias)).
    Shape: x [T, in]; weight [out, in]; bias [out] or None; out [T, out] in x's dtype or None;
    returns [T, out] in x's dtype (`out` itself when given).
    """
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype) if out is None else out.copy_(y)


def linear_for(device: torch.device, dtype: torch.dtype, flags: frozenset[str] | None = None) -> Callable:
    """`linear` where the device multiplies `dtype` natively; upcast_linear on a CPU that cannot."""
    if device.type != "cpu" or dtype not in NATIVE_FLAGS:
        return linear
    flags = cpu_flags() if flags is None else flags
    return linear if flags & set(NATIVE_FLAGS[dtype]) else upcast_linear
