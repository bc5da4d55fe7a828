"""--kv-cache-dtype: vLLM's names for what the paged KV pool stores, and the torch dtype each resolves to.

`auto` stores the activation dtype. The fp8 formats store a quarter of float32's bytes (half of
bfloat16's) with a scale of 1.0, as vLLM does without calibrated scales (kernels.attention_ref), so the
same memory holds 4x (2x) the blocks. On a CPU both run on the torch path; on a GPU the Triton
kernels read them, and Triton's e4m3 (fp8e4nv) needs compute capability 8.9 (Ada, Hopper).
"""
from __future__ import annotations

import torch

# check_kv_cache_dtype_name: importable from here as before (the names live with the cache config, torch-free).
from server.engine.config.cache import KV_CACHE_DTYPE_NAMES, check_kv_cache_dtype_name

# Each name's torch dtype (None: auto, the activation dtype).
KV_CACHE_DTYPES = {name: None if attr is None else getattr(torch, attr) for name, attr in KV_CACHE_DTYPE_NAMES.items()}
# Triton converts fp8e4nv from this compute capability on.
E4M3_MIN_CAPABILITY = (8, 9)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device,
                           capability: tuple[int, int] | None = None) -> torch.dtype:
    """The pool's torch dtype; ValueError for a format the device cannot run.
    capability: the CUDA device's (major, minor), read from the device when None."""
    check_kv_cache_dtype_name(name)
    dtype = KV_CACHE_DTYPES[name]
    if dtype is None:
        return model_dtype
    if dtype == torch.float8_e4m3fn and device.type == "cuda":
        capability = capability or torch.cuda.get_device_capability(device)
        if tuple(capability) < E4M3_MIN_CAPABILITY:
            raise ValueError(f"kv_cache_dtype {name!r} needs a GPU of compute capability >= 8.9 (Ada, Hopper); "
                             f"{device} has {capability[0]}.{capability[1]}: use fp8_e5m2 or auto")
    return dtype


def kv_cache_dtype_label(dtype: torch.dtype) -> str:
    """The name /admin/engine shows: vLLM's for fp8, else the torch dtype's (auto resolved)."""
    names = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
    return names.get(dtype, str(dtype).removeprefix("torch."))
