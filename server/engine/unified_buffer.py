"""--unified-memory's one allocation (server.engine.unified_memory): one byte buffer that the per-layer KV
caches and the adapter page buffers are typed, strided views of, so a unit lent to adapter pages is the
memory a KV block would have used (on CUDA nothing else could lend bytes: two allocations cannot).

Layout, in bytes: the zero page (units_per_page units, never lent), then the pool's `units` units.

- A unit is one KV block of every layer, token-major: [block_size, 2 x layers, Hkv, D] of the KV dtype.
  Layer l's K is the view [units, block_size, Hkv, D] at element offset 2l x Hkv x D (V at 2l + 1), strides
  (block_size x 2L x Hkv x D, 2L x Hkv x D, D, 1). Token-major rather than layer-major so that a block's
  tokens still merge with the block dimension (the torch reference's and write_kv's view(-1, Hkv, D));
  the Triton kernels take every stride.
- Page p is bytes p x units_per_page units on, so page p >= 1 is the units of KV blocks
  (p - 1) x units_per_page .. p x units_per_page - 1 (BlockManager.lend's aligned group p - 1). Within a page,
  layer by layer, each projection group's A then its B's, in LoraGroupBuffers.page_tensors' order and
  shapes: each module tensor is a [pages, ...] view whose page stride is the page's bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from server.engine.kv_cache import lazy_cpu_zeros
from server.engine.lora.slots import LoraGroupBuffers
from server.engine.unified_memory import UnifiedPool


def unallocated(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A stand-in of `shape` that holds no memory (every element the one zero): the adapter buffers' shapes
    while the model is built, before the pool is sized and its pages carved (LoraGroupBuffers.repage)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


@dataclass(frozen=True)
class UnifiedBuffer:
    pool: UnifiedPool
    data: torch.Tensor  # [(units_per_page + units) x unit_bytes] uint8

    @classmethod
    def allocate(cls, pool: UnifiedPool, device) -> UnifiedBuffer:
        """Zeroed; on a CPU mapped on first touch, as the KV pool is (kv_cache.lazy_cpu_zeros)."""
        nbytes = (pool.units_per_page + pool.units) * pool.unit_bytes
        zeros = lazy_cpu_zeros if torch.device(device).type == "cpu" else torch.zeros
        return cls(pool, zeros((nbytes,), dtype=torch.uint8, device=device))

    @property
    def page_bytes(self) -> torch.Tensor:
        """[pages + 1, page bytes] uint8: each page's bytes, the zero page first."""
        pages = self.pool.pages + 1
        return self.data[: pages * self.pool.page_bytes].view(pages, self.pool.page_bytes)

    def kv_caches(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), each [units, block_size, Hkv, D] of `dtype`, block b at unit b."""
        elem = _element_size(dtype)
        token = 2 * num_layers * num_kv_heads * head_dim  # elements: every layer's K and V of one token
        assert block_size * token * elem == self.pool.unit_bytes, (num_layers, block_size, dtype, self.pool)
        typed = self._typed(dtype)
        start = self.pool.page_bytes // elem  # past the zero page
        shape = (self.pool.units, block_size, num_kv_heads, head_dim)
        stride = (block_size * token, token, head_dim, 1)
        return [tuple(typed.as_strided(shape, stride, start + (2 * layer + half) * num_kv_heads * head_dim)
                      for half in (0, 1)) for layer in range(num_layers)]

    def carve_pages(self, layers: list[dict[str, LoraGroupBuffers]]) -> None:
        """Point every group's A and B at the pool's pages (in place: the model and the slots hold the groups)."""
        carver = _PageCarver(self)
        for groups in layers:
            for buffers in groups.values():
                buffers.repage(self.pool.pages + 1, carver)
        assert carver.at <= self.pool.page_bytes, (carver.at, self.pool)

    def _typed(self, dtype: torch.dtype) -> torch.Tensor:
        assert self.data.numel() % _element_size(dtype) == 0, (self.data.numel(), dtype)
        return self.data.view(dtype)


class _PageCarver:
    """`zeros(shape, dtype=, device=)` for LoraGroupBuffers.page_tensors: each call the next bytes of every
    page, as a [pages, ...] view strided by the page's bytes."""

    def __init__(self, buffer: UnifiedBuffer) -> None:
        self.buffer = buffer
        self.at = 0  # bytes of a page carved so far

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        elem, page = _element_size(dtype), self.buffer.pool.page_bytes
        assert self.at % elem == 0 and page % elem == 0, (self.at, page, dtype)
        inner = shape[1:]
        strides = tuple(math.prod(inner[i + 1:]) for i in range(len(inner)))
        view = self.buffer._typed(dtype).as_strided(shape, (page // elem, *strides), self.at // elem)
        self.at += math.prod(inner) * elem
        return view


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
