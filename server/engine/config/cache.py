"""CacheConfig: the paged KV pool (block size, how many blocks, what they store) and prefix caching."""
from __future__ import annotations

from dataclasses import dataclass

from server.engine.config.checks import check_at_least, check_bools

# vLLM's --kv-cache-dtype names, each with the torch dtype's attribute name it stores (server.engine.
# kv_cache_dtype resolves them); auto: the activation dtype. Names only here: configs import no torch.
KV_CACHE_DTYPE_NAMES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def check_kv_cache_dtype_name(name: str) -> None:
    """Raises ValueError, naming the supported values, for a name loraplex does not serve."""
    if name not in KV_CACHE_DTYPE_NAMES:
        why = (" (int8 KV is not implemented: fp8 runs on the CPU too)" if name == "int8" else "")
        raise ValueError(f"kv_cache_dtype {name!r} is not supported{why}; supported: {', '.join(KV_CACHE_DTYPE_NAMES)}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_blocks: int | None = None  # None: sized from memory (server.engine.kv_cache)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int | None = None  # the CPU KV pool; None: a share of memory (server.engine.kv_cache)
    # vLLM's --kv-cache-dtype: what the KV pool stores (server.engine.kv_cache_dtype); auto: the model dtype.
    kv_cache_dtype: str = "auto"
    # Prefix caching (server.engine.block_manager): full prompt blocks are reused across requests of one
    # tenant, adapter version and cache_salt. Sharing unsalted base-model blocks across tenants lets one
    # tenant learn from time to first token whether another sent a prompt: off unless the operator opts in.
    enable_prefix_caching: bool = True
    share_base_prefix_cache: bool = False

    def __post_init__(self) -> None:
        check_at_least(self, 1, "block_size", "kv_cache_blocks", "cpu_kv_cache_bytes")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        check_kv_cache_dtype_name(self.kv_cache_dtype)
        check_bools(self, "enable_prefix_caching", "share_base_prefix_cache")
