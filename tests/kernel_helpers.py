"""Helpers shared by the kernel test files: bit-exact comparison (the AOT compile check,
benchmarks/aot/aot.py, lowers every kernel to CUDA without a GPU)."""
from __future__ import annotations

import torch


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal on the raw bits, so NaN sentinels compare equal to themselves."""
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
