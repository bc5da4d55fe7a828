"""Handing freed host memory back to the OS after the model is built.

Quantizing frees every float projection once its int8 or int4 copy exists, a few MiB at a time,
interleaved with the quantized tensors' allocations. glibc's malloc raises its mmap threshold each
time a large mapped block is freed (up to 32 MiB), so after the first few the rest are carved from
the heap, and the holes they leave stay in the process's RSS: the same int8 load measured 1,152 to
1,433 MiB from run to run on the default model. malloc_trim(0) returns every free page of the heap.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def return_freed_memory() -> None:
    """glibc's malloc_trim(0); nothing where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        log.debug("no malloc_trim in this C library: freed host memory stays with the allocator")
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
