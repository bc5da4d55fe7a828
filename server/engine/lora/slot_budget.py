"""How many adapter slots fit in a share of the accelerator's memory (issue 21, item 4).

Slots are fixed-size: every targeted projection of every layer holds A and B at
`max_lora_rank`, a float32 scaling and a float32 DoRA scale per output column
(server.engine.lora.slots), so one slot's bytes follow from the model's shape,
the rank and the dtype alone, and the slot count from a byte budget. Rank-16
slots for Llama-3-8B in bf16 are 89 MB each (83.9 MB of A and B), so 64 of
them take 5.7 GB: 9% of what an 80 GB card has left beside the 16 GB of
weights, the rest going to the KV cache.

With `--lora-page-rows` the same bytes hold pages of rank rows instead of slots (server.engine.lora.paging):
the slot count sized here is then the pool's budget, in max-rank slots' worth.

The engine sizes its slots so when `max_loras` is unset (EngineConfig, the `LLM` API, `--max-loras
auto`) on CUDA; the CPU keeps its fixed default. The CLI's default is still 8.
"""
from __future__ import annotations

import torch

from server.engine.config import ModelConfig
from server.engine.kv_cache import allocate_lora_slots

# The share of the memory left beside the weights that slots may take; the KV cache gets the rest.
LORA_MEMORY_SHARE = 0.10
# Slots when max_loras is unset and no device memory is measured (the CPU: unchanged).
CPU_DEFAULT_LORAS = 8
# Slots sized from memory stop here: each slot is a program row of every padded decode launch's
# bound and an entry of the per-step slot tables.
MAX_AUTO_LORAS = 256


class SlotBudgetError(ValueError):
    """Not even one slot fits in the budget."""


def slot_bytes(mcfg: ModelConfig, max_rank: int, dtype: torch.dtype) -> int:
    """Device bytes one adapter slot adds, over every layer and projection group (measured on `meta`
    buffers as the engine allocates them: two slots minus one)."""
    def total(slots: int) -> int:
        n = 0
        for layer in allocate_lora_slots(mcfg, slots, max_rank, dtype, "meta"):
            for g in layer.values():
                n += sum(t.numel() * t.element_size() for t in g.tensors())
        return n

    return total(2) - total(1)


def slots_for_memory(mcfg: ModelConfig, max_rank: int, dtype: torch.dtype, free_bytes: int,
                     share: float = LORA_MEMORY_SHARE) -> int:
    """The slot count at `max_rank` that fits in `share` of `free_bytes` (the device's free memory with
    the weights loaded, before the KV cache), at most MAX_AUTO_LORAS; SlotBudgetError if none fits."""
    assert 0 < share <= 1, share
    per_slot = slot_bytes(mcfg, max_rank, dtype)
    budget = int(share * max(free_bytes, 0))
    slots = min(MAX_AUTO_LORAS, budget // per_slot)
    if slots < 1:
        raise SlotBudgetError(
            f"one adapter slot at max_lora_rank {max_rank} takes {per_slot / 2**20:.1f} MiB, over the "
            f"{budget / 2**20:.1f} MiB budget ({share:.0%} of {max(free_bytes, 0) / 2**30:.2f} GiB free): "
            f"lower max_lora_rank or free device memory")
    return slots


def resolve_max_loras(requested: int | None, mcfg: ModelConfig, max_rank: int, dtype: torch.dtype,
                      free_bytes: int | None) -> tuple[int, str]:
    """(slots, the start-up log line saying why): `requested` when given; else sized from `free_bytes`
    (CUDA: the device's free memory with the weights loaded) by slots_for_memory; else
    CPU_DEFAULT_LORAS."""
    if requested is not None:
        return requested, f"{requested} adapter slots (max_loras)"
    if free_bytes is None:
        return CPU_DEFAULT_LORAS, f"{CPU_DEFAULT_LORAS} adapter slots (max_loras unset: the CPU default)"
    slots = slots_for_memory(mcfg, max_rank, dtype, free_bytes)
    per_slot = slot_bytes(mcfg, max_rank, dtype)
    return slots, (f"{slots} adapter slots at max_lora_rank {max_rank}: {slots * per_slot / 2**30:.2f} GiB, "
                   f"{per_slot / 2**20:.1f} MiB each, within {LORA_MEMORY_SHARE:.0%} of the "
                   f"{free_bytes / 2**30:.2f} GiB free beside the weights (max_loras unset; the KV cache "
                   f"gets the rest)")


def free_device_bytes(device: torch.device) -> int | None:
    """Free bytes on a CUDA device once the allocator's cached blocks are returned (as the KV sizing
    measures them, server.engine.kv_cache); None elsewhere (nothing is sized from memory there)."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]
