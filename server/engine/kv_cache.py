"""Preallocated device memory: the paged KV pool and the LoRA slot buffers, at maximum sizes."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from server.engine.config import EngineConfig, ModelConfig
from server.engine.kv_cache_dtype import kv_cache_dtype_label
from server.engine.lora.expert_buffers import ExpertLoraBuffers
from server.engine.lora.paging import LoraPaging
from server.engine.lora.slots import LoraGroupBuffers
from server.engine.sliding_window import sequence_blocks
from server.engine.unified_memory import UnifiedPool

if TYPE_CHECKING:
    from server.engine.unified_buffer import UnifiedBuffer


def kv_bytes_per_block(mcfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """A block's bytes of every layer's KV (what kv_cache_blocks counts)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * mcfg.num_layers * block_size * mcfg.num_kv_heads * mcfg.head_dim * elem


def pool_block_bytes(mcfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """A block of the pool: every layer's KV, or one KV layer group's where the model has several
    (server.engine.kv_groups)."""
    return kv_bytes_per_block(mcfg, block_size, dtype) * pool_layers(mcfg) // mcfg.num_layers


def pool_layers(mcfg: ModelConfig) -> int:
    """Layers whose KV one block holds: all of them, or one KV layer group's."""
    groups = mcfg.kv_groups
    return mcfg.num_layers if groups is None else groups.layers_per_group


def held_blocks(mcfg: ModelConfig, length: int, block_size: int, chunk: int) -> int:
    """The most blocks one sequence of `length` tokens holds at once (server.engine.sliding_window.
    sequence_blocks), over every KV layer group's table where the model has several."""
    groups = mcfg.kv_groups
    if groups is None:
        return sequence_blocks(length, block_size, mcfg.kv_window, chunk)
    return groups.held_blocks(length, block_size, chunk)


def activation_bytes(mcfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """An upper bound on one step's live activations, which the KV pool must leave room for.

    Per token at the MLP, the widest point: the residual, the normed input, gate_up's output (2 x I),
    silu(gate) and its product with up (I each), down's output, plus the attention's q/k/v; per sampled
    row, the logits in the model dtype and their float32 copies.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = 4 * mcfg.hidden_size + 4 * mcfg.intermediate_size + mcfg.q_size + 2 * mcfg.kv_size
    return max_num_batched_tokens * per_token * elem + max_num_seqs * mcfg.vocab_size * (elem + 8)


def kv_pool_bytes(free: int, total: int, utilization: float, reserve: int) -> int:
    """Bytes the KV pool may take: the engine may use `utilization` of the device in all; what is in use
    already (weights, LoRA slots, other processes) and `reserve` (one step's activations) come off."""
    return int(total * utilization) - (total - free) - reserve


# The CPU pool's default share of the machine's memory, and its cap. vLLM's CPU backend reserves a
# fixed KV space (VLLM_CPU_KVCACHE_SPACE, 4 GiB by default for years); on a small machine a fixed 4 GiB
# is a large share of memory, so here it is a tenth of physical memory up to that same 4 GiB.
CPU_KV_MEMORY_FRACTION = 0.1
CPU_KV_MAX_BYTES = 4 << 30


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_kv_budget_bytes(total_memory: int, per_block: int, max_num_seqs: int, blocks_per_seq: int) -> int:
    """The CPU pool's bytes when not given: CPU_KV_MEMORY_FRACTION of the machine's memory up to
    CPU_KV_MAX_BYTES, and never more than max_num_seqs sequences of the model's full length can use
    (the pool is zeroed, so every byte of it is resident)."""
    useful = max_num_seqs * blocks_per_seq * per_block
    return min(int(total_memory * CPU_KV_MEMORY_FRACTION), CPU_KV_MAX_BYTES, useful)


def num_kv_blocks(mcfg: ModelConfig, cfg: EngineConfig, dtype: torch.dtype, device: torch.device,
                  max_len: int, cache_dtype: torch.dtype | None = None, draft: ModelConfig | None = None) -> int:
    """max_len: the longest sequence the pool may have to hold (the model's limit when unset);
    dtype: the activations'; cache_dtype: what the pool stores (dtype when None): a byte budget holds
    4x the float32 blocks in fp8. draft: a draft model (speculative decoding) whose pool has as many
    blocks: the budget pays for both."""
    if cfg.cache.kv_cache_blocks is not None:
        # Blocks of every layer's KV: as many bytes in blocks of one KV layer group's layers.
        return cfg.cache.kv_cache_blocks * mcfg.num_layers // pool_layers(mcfg)
    per_block = pool_block_bytes(mcfg, cfg.cache.block_size, cache_dtype or dtype)
    if draft is not None:
        per_block += kv_bytes_per_block(draft, cfg.cache.block_size, cache_dtype or dtype)
    if device.type == "cuda":
        # Freed tensors (the unfused projections) stay in PyTorch's cache, invisible to mem_get_info.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        reserve = activation_bytes(mcfg, cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs, dtype)
        budget = kv_pool_bytes(free, total, cfg.cache.gpu_memory_utilization, reserve)
    elif cfg.cache.cpu_kv_cache_bytes is not None:
        budget = cfg.cache.cpu_kv_cache_bytes
    else:
        blocks_per_seq = held_blocks(mcfg, max_len, cfg.cache.block_size, cfg.scheduler.max_num_batched_tokens)
        budget = cpu_kv_budget_bytes(physical_memory_bytes(), per_block, cfg.scheduler.max_num_seqs, blocks_per_seq)
    return max(1, int(budget // per_block))


@dataclass(frozen=True)
class KvPoolInfo:
    """What /admin/engine shows of the pool: its dtype (kv_cache_dtype_label) and capacity."""

    dtype: str
    blocks: int  # of one KV layer group's layers where the model has several (server.engine.kv_groups)
    block_size: int
    bytes: int
    unified: UnifiedPool | None = None  # --unified-memory: the blocks are the pool's units, shared with adapter pages
    groups: int = 1  # KV layer groups

    @property
    def tokens(self) -> int:
        """Token positions of every layer the pool holds."""
        return self.blocks * self.block_size // self.groups


def allocate_kv_cache(mcfg: ModelConfig, cfg: EngineConfig, max_len: int, dtype, device, cache_dtype=None,
                      draft: ModelConfig | None = None, unified: UnifiedBuffer | None = None):
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv, D] of cache_dtype (dtype, the
    activations', when None), and the pool's KvPoolInfo; whether a sequence of the chosen length fits
    is server.engine.context_len's to say. draft: sized so that a draft model's pool of as many blocks
    (kv_pool_like) fits too. unified: views of its buffer, a block for each of the unified pool's units."""
    cache_dtype = cache_dtype or dtype
    if unified is not None:  # refused for a model with KV layer groups (server.engine.unified_memory)
        blocks = unified.pool.units
        caches = unified.kv_caches(mcfg.num_layers, cfg.cache.block_size, mcfg.num_kv_heads, mcfg.head_dim, cache_dtype)
    else:
        blocks = num_kv_blocks(mcfg, cfg, dtype, device, max_len, cache_dtype, draft)
        caches = kv_pool_like(mcfg, blocks, cfg.cache.block_size, cache_dtype, device)
        groups = mcfg.kv_groups
        if groups is not None:  # one tensor per place in a group, shared by that place's layer of every group
            caches = [caches[slot] for slot in groups.layer_slot]
    info = KvPoolInfo(kv_cache_dtype_label(cache_dtype), blocks, cfg.cache.block_size,
                      blocks * pool_block_bytes(mcfg, cfg.cache.block_size, cache_dtype),
                      unified=None if unified is None else unified.pool, groups=mcfg.num_layers // pool_layers(mcfg))
    return caches, info


def kv_pool_like(mcfg: ModelConfig, blocks: int, block_size: int, cache_dtype: torch.dtype,
                 device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer of `mcfg` (of one KV layer group where it has several), (k_cache, v_cache) of `blocks`
    blocks, zeroed."""
    shape = (blocks, block_size, mcfg.num_kv_heads, mcfg.head_dim)
    zeros = lazy_cpu_zeros if torch.device(device).type == "cpu" else torch.zeros
    return [(zeros(shape, dtype=cache_dtype, device=device), zeros(shape, dtype=cache_dtype, device=device))
            for _ in range(pool_layers(mcfg))]


def lazy_cpu_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros whose pages the OS maps on first touch: numpy's zeros is calloc, which takes fresh
    (already zero) pages for large sizes, where torch.zeros writes every byte. A pool of gigabytes
    then costs nothing at start-up and only the memory that sequences use."""
    import numpy as np

    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _group_shapes(mcfg: ModelConfig, sparse: bool) -> dict[str, tuple[int, tuple[int, ...]]]:
    """A layer's fused projection groups: name -> (in features, each slice's out features)."""
    h, q, kv, inter = mcfg.hidden_size, mcfg.q_size, mcfg.kv_size, mcfg.intermediate_size
    attention = {"qkv": (h, (q, kv, kv)), "o": (q, (h,))}
    return attention if sparse else attention | {"gate_up": (h, (inter, inter)), "down": (inter, (h,))}


def lora_page_bytes(mcfg: ModelConfig, page_rows: int, dtype: torch.dtype) -> int:
    """Bytes one adapter page takes: `page_rows` rank rows of A and B of every group of every (dense) layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    rows = sum(page_rows * (len(outs) * in_f + sum(outs))
               for i in range(mcfg.num_layers) for in_f, outs in _group_shapes(mcfg, mcfg.is_sparse(i)).values())
    return rows * elem


def allocate_lora_slots(mcfg: ModelConfig, max_loras: int, max_rank: int, dtype, device,
                        paging: LoraPaging | None = None, pages: Callable | None = None,
                        expert_zeros: Callable = torch.zeros):
    """Per layer, the slot buffers of each fused projection group: `max_loras` slots of max_rank rows, or
    the layout `paging` gives (entries, and pages of its page rows: server.engine.lora.paging). An MoE
    layer's experts: one group per fused expert weight, in slots (server.engine.lora.expert_buffers); the
    dense layers of an MoE model (Qwen3-MoE's) have the dense MLP's groups instead. pages: what makes A and
    B (`zeros(shape, dtype=, device=)`; None: torch.zeros): --unified-memory's stand-ins until the pool's
    buffer is carved (server.engine.unified_buffer); expert_zeros: what makes the experts' (never the pool's:
    they keep slots), stand-ins too for the draft model's slots until an adapter brings a draft LoRA
    (server.engine.lora.draft_slots)."""
    paging = paging or LoraPaging.slots(max_loras, max_rank)
    h = mcfg.hidden_size
    zeros = pages or torch.zeros

    def layer(sparse: bool) -> dict:
        groups = {group: LoraGroupBuffers.allocate(in_f, outs, paging.entries, paging.page_rows, dtype, device,
                                                   paging.pages, paging.dora_entries, zeros)
                  for group, (in_f, outs) in _group_shapes(mcfg, sparse).items()}
        if sparse:
            e, i = mcfg.num_experts, mcfg.moe_intermediate_size
            groups["experts_gate_up"] = ExpertLoraBuffers.allocate(e, h, 2 * i, max_loras, max_rank, dtype, device,
                                                                   expert_zeros)
            groups["experts_down"] = ExpertLoraBuffers.allocate(e, i, h, max_loras, max_rank, dtype, device,
                                                                expert_zeros)
        return groups

    return [layer(mcfg.is_sparse(i)) for i in range(mcfg.num_layers)]
