"""Preallocated device memory: the paged KV pool and the LoRA slot buffers, at maximum sizes."""
from __future__ import annotations

import torch

from server.engine.config import EngineConfig, ModelConfig
from server.engine.lora_slots import LoraGroupBuffers


def kv_bytes_per_block(mcfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * mcfg.num_layers * block_size * mcfg.num_kv_heads * mcfg.head_dim * elem


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


def num_kv_blocks(mcfg: ModelConfig, cfg: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    if cfg.kv_cache_blocks is not None:
        return cfg.kv_cache_blocks
    per_block = kv_bytes_per_block(mcfg, cfg.block_size, dtype)
    if device.type == "cuda":
        # Freed tensors (the unfused projections) stay in PyTorch's cache, invisible to mem_get_info.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        reserve = activation_bytes(mcfg, cfg.max_num_batched_tokens, cfg.max_num_seqs, dtype)
        budget = kv_pool_bytes(free, total, cfg.gpu_memory_utilization, reserve)
    else:
        budget = cfg.cpu_kv_cache_bytes
    return max(1, int(budget // per_block))


def allocate_kv_cache(mcfg: ModelConfig, cfg: EngineConfig, max_model_len: int, dtype, device):
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]."""
    blocks = num_kv_blocks(mcfg, cfg, dtype, device)
    need = (max_model_len + cfg.block_size - 1) // cfg.block_size
    if blocks < need:
        raise ValueError(
            f"the KV pool has {blocks} blocks of {cfg.block_size} tokens but one max_model_len "
            f"({max_model_len}) sequence needs {need}: raise kv_cache_blocks or lower max_model_len"
        )
    shape = (blocks, cfg.block_size, mcfg.num_kv_heads, mcfg.head_dim)
    caches = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(mcfg.num_layers)
    ]
    return caches, blocks


def allocate_lora_slots(mcfg: ModelConfig, max_loras: int, max_rank: int, dtype, device):
    """Per layer, the slot buffers of each fused projection group."""
    h, q, kv, inter = mcfg.hidden_size, mcfg.q_size, mcfg.kv_size, mcfg.intermediate_size
    shapes = {"qkv": (h, (q, kv, kv)), "o": (q, (h,)), "gate_up": (h, (inter, inter)), "down": (inter, (h,))}
    return [
        {
            group: LoraGroupBuffers.allocate(in_f, outs, max_loras, max_rank, dtype, device)
            for group, (in_f, outs) in shapes.items()
        }
        for _ in range(mcfg.num_layers)
    ]
