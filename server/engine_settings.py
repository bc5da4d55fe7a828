"""The serve command's engine settings: ServerConfig's engine fields as the EngineConfig they build.

The one place the mapping lives (issue 35, item 4: later ServerConfig holds the EngineConfig itself).
Settings the server words differently from the engine are resolved here: the prefill cap's device
default, and --max-cpu-loras (a count) as the engine's host budget in bytes.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from adapters.format import PROJECTIONS, ModelShape
from server.config import ServerConfig
from server.engine.config import EngineConfig, ModelConfig


def cpu_loras_bytes(shape: ModelShape, max_lora_rank: int, itemsize: int, count: int) -> int:
    """vLLM's --max-cpu-loras as a byte budget: room for `count` adapters of the largest rank on all
    seven projections of every layer, in the serving dtype."""
    per_layer = sum(max_lora_rank * sum(shape.in_out(p)) for p in PROJECTIONS)
    return count * shape.num_layers * per_layer * itemsize


def engine_config(config: ServerConfig, model_dir: str, shape: ModelShape) -> EngineConfig:
    """`model_dir`: the resolved checkpoint; `shape`: its adapter shape."""
    engine = EngineConfig(
        model=model_dir, device=config.device, dtype=config.dtype,
        max_loras=config.max_loras, max_lora_rank=config.max_lora_rank, lora_page_rows=config.lora_page_rows,
        unified_memory=config.unified_memory,
        max_pinned_adapters_per_tenant=config.max_pinned_adapters_per_tenant,
        max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_blocks=config.kv_cache_blocks,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_cpu_lora_bytes=config.max_cpu_lora_bytes, max_lora_vocab_bytes=config.max_lora_vocab_bytes,
        kernels=config.kernels, seed=config.seed, enforce_eager=config.enforce_eager,
        async_scheduling=config.async_scheduling, speculative_config=config.speculative_config,
        tensor_parallel_size=config.tensor_parallel_size, fully_sharded_loras=config.fully_sharded_loras,
        enable_prefix_caching=config.enable_prefix_caching,
        share_base_prefix_cache=config.share_base_prefix_cache, cpu_threads=config.cpu_threads,
        cpu_affinity=config.cpu_placement.engine if config.cpu_placement is not None else None,
        quantization=config.quantization,
        quantize_lm_head=config.quantize_lm_head, int4_group_size=config.int4_group_size,
        kv_cache_dtype=config.kv_cache_dtype,
        max_mask_fill_seconds=config.max_grammar_mask_ms / 1000,
        max_mask_seconds_per_request=config.max_grammar_mask_seconds)
    device = engine.resolve_device()
    engine = dataclasses.replace(engine, max_prefill_tokens_while_decoding=config.prefill_cap_for(device.type),
                                 max_prefill_step_ratio=config.prefill_step_ratio_for(device.type))
    if config.max_cpu_loras is not None:
        itemsize = engine.resolve_dtype(ModelConfig.from_dir(Path(model_dir)), device).itemsize
        engine = dataclasses.replace(engine, max_cpu_lora_bytes=cpu_loras_bytes(
            shape, config.max_lora_rank, itemsize, config.max_cpu_loras))
    return engine
