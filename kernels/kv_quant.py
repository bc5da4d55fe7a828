"""An fp8 KV cache: what is stored for a key or value, and the byte view that torch's CPU ops need.

vLLM's `--kv-cache-dtype fp8_e4m3|fp8_e5m2` without calibrated scales stores each element cast to
fp8 with a scale of 1.0, saturating at the format's largest finite value; the attention reads the
cache back in float32. The same here, on both the torch and the Triton paths, so both hold the same
bytes: the cast is torch's (round to nearest even) on either, since Triton's interpreter rounds fp8
toward zero. torch's CPU index_copy_ and where have no fp8 kernels, so writes go through a uint8
view of the same memory (reads, index_select and .float(), work on fp8 directly).
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it.

    Semantics: fp8: clamp(x, -max, max) rounded to the nearest fp8 value (max = the format's largest
    finite value: e4m3fn has no infinity and would store NaN, e5m2 would store inf); else x.to(cache_dtype).
    Shape: any; the result has x's shape.
    """
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return x.clamp(-limit, limit).to(cache_dtype)


def reads_exactly(cache_dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
    """Whether every cache value converts exactly to compute_dtype, so a kernel may read it in that
    dtype (e4m3 and e5m2 are subsets of bfloat16 and float16: fewer mantissa bits, smaller range)."""
    return cache_dtype == compute_dtype or (is_fp8(cache_dtype) and compute_dtype in (torch.bfloat16, torch.float16))


def storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a dtype torch's CPU scatter ops support: uint8 for fp8, else itself.

    Shape: t's (both fp8 formats are one byte)."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x converted for `cache` and viewed as storage(cache) views it: what a scatter into it writes."""
    return storage(to_cache_dtype(x, cache.dtype))
