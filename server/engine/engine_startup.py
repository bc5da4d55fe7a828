"""LLMEngine's start-up, step by step; the engine takes the parts built here.

The order is the point: the device is bound and the dtypes refused or chosen
before anything loads; the weights load; the adapter slots and the LoRA
scratch are allocated before the KV pool, which is sized from what the rest
left (on CUDA); kernels are compiled and decode graphs captured last, when
every buffer they read exists.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from transformers import PreTrainedTokenizerBase

from adapters.expert_linears import EXPERT_LINEARS
from adapters.format import FUSED_PROJECTION_ARCHS, ModelShape
from adapters.host_tier import Fetch, HostTier
from adapters.packed import PackedLoraAdapter
from kernels.cpu_linear import upcast_linear
from kernels.int8_weights import dequant_linear
from server.engine.architectures import ARCHITECTURES
from server.engine.async_step import AsyncScheduling
from server.engine.block_manager import BlockManager
from server.engine.config import EngineConfig, ModelConfig, ModelConfigError
from server.engine.context_len import choose_max_model_len, model_limit
from server.engine.cuda_device import thread_binder
from server.engine.draft_model_loader import draft_adapter_shape, load_draft_model, read_draft_config
from server.engine.draft_model_proposer import DraftModelProposer
from server.engine.flag_refusals import combination_refusal
from server.engine.grammar import GrammarMask, Grammars
from server.engine.kernel_choice import select_kernels
from server.engine.kernel_ops import KernelOps
from server.engine.kv_cache import (KvPoolInfo, allocate_kv_cache, allocate_lora_slots, held_blocks,
                                    kv_bytes_per_block, kv_pool_like, lora_page_bytes, num_kv_blocks)
from server.engine.kv_cache_dtype import resolve_kv_cache_dtype
from server.engine.lora.dora_precompute import DoraPrecompute
from server.engine.lora.dora_scale_cache import ScaleStore
from server.engine.lora.dora_scales import DoraScales
from server.engine.lora.host_budget import max_adapter_bytes
from server.engine.lora.page_gathers import PageGathers
from server.engine.lora.paging import LoraPaging
from server.engine.lora.slot_budget import free_device_bytes, resolve_max_loras
from server.engine.lora.slots import LoraSlots
from server.engine.lora.vocab_parts import VocabParts
from server.engine.mask_lane import MaskBudget
from adapters.medusa_format import HeadWeights, read_heads_dir
from server.default_model import medusa_heads_dir
from server.engine.medusa_heads import MedusaHeads
from server.engine.medusa_proposer import MedusaProposer
from server.engine.model import CausalLM
from server.engine.model_runner import ModelRunner
from server.engine.output_processor import OutputProcessor
from server.engine.parallel.tp_leader import start_tensor_parallel
from server.engine.scheduler import PREFETCH_WINDOW, Scheduler, SchedulerLimits, StepCost
from server.engine.speculative_config import resolve_disable_by_batch_size
from server.engine.step_latency import LatencyCap
from server.engine.tokenizer_loader import load_tokenizer
from server.engine.unified_buffer import UnifiedBuffer, unallocated
from server.engine.unified_memory import PageUnits, UnifiedPool
from server.engine.warmup import warm_up
from server.engine.weights import served_model, served_weights

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything LLMEngine serves with, built and ready."""

    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    bind_thread: Callable[[], None]  # makes the engine's device current on the calling thread
    dtype: torch.dtype
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    adapter_shape: ModelShape
    draft_adapter_shape: ModelShape | None  # what an adapter's draft LoRA must fit; None: no draft model
    max_loras: int
    model: CausalLM
    lora_slots: LoraSlots
    kv_pool: KvPoolInfo
    max_model_len: int
    blocks: BlockManager
    host: HostTier
    scheduler: Scheduler
    kernels: KernelOps
    grammars: Grammars
    runner: ModelRunner
    warmup_seconds: float
    dora_precompute: DoraPrecompute
    overlap: AsyncScheduling | None  # None: every step synchronous
    output_processor: OutputProcessor


def build_engine_parts(config: EngineConfig, adapter_source: Fetch | None,
                       dora_scale_store: ScaleStore | None) -> EngineParts:
    if config.model is None:
        raise ValueError("EngineConfig.model is unset: give the checkpoint's directory")
    mcfg = ModelConfig.from_dir(config.model)
    medusa_heads = _read_medusa_heads(config, mcfg)  # before the model loads: a misfit is refused at once
    spec = config.speculative_config
    draft_cfg = read_draft_config(spec.model, mcfg) if spec is not None and spec.method == "draft_model" else None
    device, bind_thread, dtype, kv_dtype = _set_up_device(config, mcfg)
    config = config.resolved_for(device.type)  # the prefill cap's auto, by device type
    # Until the KV pool is sized, the longest context the model allows (or the one asked for).
    limit = model_limit(mcfg, config.scheduler.max_model_len)
    max_len = config.scheduler.max_model_len or limit
    tokenizer, eos_token_ids = _load_tokenizer(config, mcfg)
    tensor_parallel = config.parallel.tensor_parallel_size > 1
    if tensor_parallel and device.type != "cpu":
        raise ModelConfigError(f"--tensor-parallel-size {config.parallel.tensor_parallel_size} runs on CPU devices "
                               f"(gloo) for now, not {device}")
    if (refusal := combination_refusal(config, mcfg, draft_cfg is not None, config.model)) is not None:
        raise ModelConfigError(refusal)
    paging, lora_layers, model = _load_model(config, mcfg, dtype, device, max_len)
    max_loras = paging.entries
    # Everything else on the device is allocated before the KV pool is sized from what is left.
    # Not sharded yet: adapters' parts of embed_tokens/lm_head (without VocabParts LLMEngine.add_adapter
    # and the slots refuse them). DoRA scales are computed against the full weights, tensor parallel or
    # not (server.engine.parallel.tp_layers), so rank 0 keeps them for that.
    model.vocab_parts = None if tensor_parallel else VocabParts.of_model(model, max_loras)
    slots = LoraSlots(lora_layers, max_loras, DoraScales.of_model(model),
                      dora_scale_store, paging, config.lora.max_pinned_adapters_per_tenant, vocab=model.vocab_parts)
    scratch = torch.empty(3, config.scheduler.max_num_batched_tokens, config.lora.max_lora_rank, dtype=dtype,
                          device=device)
    draft_tokens = max(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
    draft_model, draft_loras = (None, None) if draft_cfg is None else load_draft_model(
        spec.model, draft_cfg, dtype, device, max_len, draft_tokens, max_loras, config.lora.max_lora_rank)
    slots.draft = draft_loras  # adapters' draft LoRAs load and leave with their slot
    # Unified: the pool sized now, as the KV pool is, from what is left; the adapter pages carved from it.
    memory = _unified_memory(config, mcfg, dtype, device, max_len, kv_dtype, paging, lora_layers) \
        if config.lora.unified_memory else None
    kv_caches, kv_pool = allocate_kv_cache(mcfg, config, max_len, dtype, device, kv_dtype, draft_cfg, memory)
    # Unified, a sequence is sized against the KV share: adapters in use may hold the rest.
    kv_blocks = kv_pool.blocks if memory is None else memory.pool.kv_share
    context = choose_max_model_len(config.scheduler.max_model_len, limit, kv_blocks, config.cache.block_size,
                                   partial(held_blocks, mcfg, block_size=config.cache.block_size,
                                           chunk=config.scheduler.max_num_batched_tokens))
    max_model_len = context.max_model_len
    log.info("%s", context.reason)
    blocks = BlockManager(kv_pool.blocks, config.cache.block_size, pack=memory is not None)
    if memory is not None:
        slots.use_pool(PageUnits(memory.pool, blocks, memory.page_bytes), memory.pool.pages + 1)
    host, scheduler = _build_tiers(config, StepCost.of(mcfg), adapter_source, device, dtype, bind_thread, slots, blocks,
                                   mcfg)
    kernels = _select_kernels(config, device, dtype)
    if draft_model is not None:  # its own pool, at the target's block ids (server.engine.draft_model_proposer)
        draft_kv = kv_pool_like(draft_cfg, kv_pool.blocks, config.cache.block_size, kv_dtype, device)
        draft_scratch = torch.empty(3, draft_tokens, config.lora.max_lora_rank, dtype=dtype, device=device)
        scheduler.draft_model = DraftModelProposer(draft_model, draft_kv, kernels, config.cache.block_size, draft_loras,
                                                   draft_scratch, device)
    # Structured output: the grammar vocabulary is the tokenizer's, as wide as the logits at least.
    budget = MaskBudget(config.scheduler.max_mask_fill_seconds, config.scheduler.max_mask_seconds_per_request)
    grammars = Grammars(tokenizer, mcfg.vocab_size, eos_token_ids, mask_budget=budget)
    runner = ModelRunner(model, kv_caches, kernels, config.cache.block_size, scratch, slots.slot_ranks,
                         slots.rank_table, device, config.device.seed, GrammarMask(grammars.info.vocab_size),
                         slots.slot_dora, slots.page_table, _page_gathers(slots, device),
                         model.vocab_parts.slot_has if model.vocab_parts is not None else None)
    if medusa_heads is not None:
        k = config.speculative_config.num_speculative_tokens
        runner.use_medusa(MedusaProposer(MedusaHeads(medusa_heads, dtype, device, model), k, model))
        slots.medusa = runner.medusa  # adapters' own heads load and leave with their slot
    warmup_seconds = _warm_up(config, model, kv_caches, kernels, scratch, max_model_len, device, slots.page_table)
    # DoRA scales at adapter intake; on a CPU engine with a store, the base identity they are keyed by now.
    dora_precompute = DoraPrecompute(host, slots.dora_cache)
    _capture_decode_graphs(config, device, kernels, runner, max_loras, max_model_len)
    if tensor_parallel:  # the workers start now: the model, slots and pool are sized
        runner = start_tensor_parallel(config, runner, lora_layers, max_len, kv_pool.blocks)
        model = runner.model
    # --async-scheduling: forwards on a worker thread while this one prepares the next step
    # (server.engine.async_step).
    overlap = AsyncScheduling(runner, scheduler, blocks, max_model_len,
                              bind_thread) if config.scheduler.async_scheduling else None
    return EngineParts(
        config=config, model_config=mcfg, device=device, bind_thread=bind_thread, dtype=dtype, tokenizer=tokenizer,
        eos_token_ids=eos_token_ids, adapter_shape=_adapter_shape(mcfg, config),
        draft_adapter_shape=draft_adapter_shape(config), max_loras=max_loras, model=model,
        lora_slots=slots, kv_pool=kv_pool, max_model_len=max_model_len, blocks=blocks, host=host, scheduler=scheduler,
        kernels=kernels, grammars=grammars, runner=runner, warmup_seconds=warmup_seconds,
        dora_precompute=dora_precompute, overlap=overlap,
        output_processor=OutputProcessor(scheduler, eos_token_ids, max_model_len))


def _read_medusa_heads(config: EngineConfig, mcfg: ModelConfig) -> HeadWeights | None:
    """--speculative-config's Medusa heads, checked against the model (MedusaHeadsError: one line)."""
    spec = config.speculative_config
    if spec is None or spec.method != "medusa":
        return None
    return read_heads_dir(medusa_heads_dir(config.model, spec.model), mcfg.hidden_size, mcfg.vocab_size,
                          spec.num_speculative_tokens)


def _set_up_device(config: EngineConfig,
                   mcfg: ModelConfig) -> tuple[torch.device, Callable[[], None], torch.dtype, torch.dtype]:
    """The device, bound on this thread, the serving dtype and the KV cache's: refused before loading."""
    device = config.device.resolve_device()
    # Every thread that touches CUDA makes the engine's device current (server.engine.cuda_device).
    bind_thread = thread_binder(device)
    bind_thread()
    dtype = config.device.resolve_dtype(mcfg, device)
    config.quantization.check_device(device, dtype)
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, device)
    if device.type == "cpu" and (threads := config.device.resolve_cpu_threads()) is not None:
        torch.set_num_threads(threads)  # process-wide: the engine owns its process
    return device, bind_thread, dtype, kv_dtype


def _load_tokenizer(config: EngineConfig, mcfg: ModelConfig) -> tuple[PreTrainedTokenizerBase, frozenset[int]]:
    """The tokenizer, and the ids that end a choice: the model's and the tokenizer's EOS."""
    tokenizer = load_tokenizer(config.model)
    eos = set(mcfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return tokenizer, frozenset(eos)


def _adapter_shape(mcfg: ModelConfig, config: EngineConfig) -> ModelShape:
    """The widths an adapter must match to be served on this model, and the engine's bounds on it."""
    return ModelShape(num_layers=mcfg.num_layers, hidden_size=mcfg.hidden_size, q_size=mcfg.q_size,
                      kv_size=mcfg.kv_size, intermediate_size=mcfg.intermediate_size, vocab_size=mcfg.vocab_size,
                      fused_projections=mcfg.architecture in FUSED_PROJECTION_ARCHS, num_experts=mcfg.num_experts,
                      moe_intermediate_size=mcfg.moe_intermediate_size,
                      max_vocab_bytes=config.lora.max_lora_vocab_bytes,
                      expert_linears=EXPERT_LINEARS.get(mcfg.architecture), dense_layers=mcfg.dense_layers)


def _unified_memory(config: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int,
                    kv_dtype: torch.dtype, paging: LoraPaging, lora_layers: list) -> UnifiedBuffer:
    """--unified-memory's pool, in KV blocks, and its one buffer, with `lora_layers`' pages carved from it. A
    given KV budget (--kv-cache-blocks, the CPU's bytes) gets the adapter budget (paging: --max-loras slots'
    worth of pages) on top; on CUDA, what the device has left is the pool, the adapter budget out of it."""
    unit = kv_bytes_per_block(mcfg, config.cache.block_size, kv_dtype)
    page = lora_page_bytes(mcfg, config.lora.lora_page_rows, dtype)
    blocks = num_kv_blocks(mcfg, config, dtype, device, max_len, kv_dtype)
    if device.type == "cuda" and config.cache.kv_cache_blocks is None:
        pool = UnifiedPool.within(blocks, unit, page, paging.pages - 1)
        if pool is None:
            raise ModelConfigError(f"--unified-memory: the device has {blocks} KV blocks' worth left, no more than "
                                   f"--max-loras {paging.dora_entries} slots' worth of adapter pages: lower "
                                   f"--max-loras or raise --gpu-memory-utilization")
    else:
        pool = UnifiedPool.of(blocks, unit, page, paging.pages - 1)
    log.info("unified memory: %d units of %d bytes (KV share %d, adapter share %d), %d per adapter page",
             pool.units, pool.unit_bytes, pool.kv_share, pool.adapter_share, pool.units_per_page)
    memory = UnifiedBuffer.allocate(pool, device)
    memory.carve_pages(lora_layers)
    return memory


def _load_model(config: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_len: int) -> tuple[LoraPaging, list, CausalLM]:
    """The adapter memory's layout (slots, or pages: server.engine.lora.paging), its LoRA buffers and the
    model that reads them (unified: stand-ins for A and B, carved from the pool once it is sized)."""
    if config.quantization.quantization is not None and not ARCHITECTURES[mcfg.architecture].quantization:
        raise ModelConfigError(f"quantization {config.quantization.quantization!r} is not supported for "
                               f"{mcfg.architecture} (its weights are served as the checkpoint's floats)")
    if config.lora.lora_page_rows is not None and mcfg.is_moe:
        # Experts' LoRA buffers are slots of max rank (server.engine.lora.expert_buffers), not pages.
        raise ModelConfigError(f"--lora-page-rows is not supported for {mcfg.architecture} (a mixture of "
                               f"experts keeps adapter slots of --max-lora-rank)")
    weights = served_weights(config, mcfg, dtype, device)
    # Slots come before the KV pool: with max_loras unset, a share of what the weights left (CUDA).
    max_loras, why = resolve_max_loras(config.lora.max_loras, mcfg, config.lora.max_lora_rank, dtype,
                                       free_device_bytes(device))
    log.info("%s", why)
    paging = LoraPaging.of(max_loras, config.lora.max_lora_rank, config.lora.lora_page_rows)
    if paging.paged:
        log.info("adapter memory paged by rank: %d pages of %d rank rows (%d slots' worth), up to %d adapters",
                 paging.pages - 1, paging.page_rows, max_loras, paging.entries)
    lora_layers = allocate_lora_slots(mcfg, max_loras, config.lora.max_lora_rank, dtype, device, paging,
                                      unallocated if config.lora.unified_memory else None)
    return paging, lora_layers, served_model(config, mcfg, weights, lora_layers, max_len)


def _build_tiers(config: EngineConfig, step_cost: StepCost, adapter_source: Fetch | None, device: torch.device,
                 dtype: torch.dtype, bind_thread: Callable[[], None], slots: LoraSlots,
                 blocks: BlockManager, mcfg: ModelConfig) -> tuple[HostTier, Scheduler]:
    """The host tier of adapters, and the scheduler over it, the slots and the KV blocks (released behind
    the model's windows: ModelConfig.kv_window, or its KV layer groups')."""
    # Parking places for finished loads match the scheduler's prefetch window: every adapter it
    # prefetches can wait, loaded, for room, instead of being fetched again.
    def prepare(adapter: PackedLoraAdapter, version: str | None) -> PackedLoraAdapter:
        # Copies of the base's embedding or lm_head dropped first (on CUDA they are at slot entry instead).
        return slots.prepare(slots.vocab.prepare(adapter) if slots.vocab is not None else adapter, version)

    budget = config.lora.host_budget_bytes(max_adapter_bytes(_adapter_shape(mcfg, config), config.lora.max_lora_rank,
                                                             dtype.itemsize))
    host = HostTier(adapter_source, budget, pin_memory=device.type == "cuda",
                    max_parked=PREFETCH_WINDOW, dtype=dtype, init_thread=bind_thread,
                    prepare=prepare if device.type == "cpu" else None)
    limits = config.scheduler
    scheduler = Scheduler(SchedulerLimits(limits.max_num_seqs, limits.max_num_batched_tokens,
                                          limits.max_prefill_tokens_while_decoding,
                                          resolve_disable_by_batch_size(config.speculative_config, device.type),
                                          step_cost, mcfg.kv_window,
                                          mcfg.kv_groups.windows if mcfg.kv_groups is not None else (),
                                          LatencyCap(limits.max_prefill_step_ratio)
                                          if limits.max_prefill_step_ratio is not None else None),
                          blocks, slots, host)
    # Eviction weighs what an adapter costs to bring back: a device copy from the host tier, or a fetch.
    slots.reload_tier = lambda version: "host" if version in host.entries else "store"
    return host, scheduler


def _page_gathers(slots: LoraSlots, device: torch.device) -> PageGathers | None:
    """Paged on a CPU: the torch path's gathers, kept while exact (server.engine.lora.page_gathers)."""
    if slots.page_table is None or device.type != "cpu":
        return None
    return PageGathers(lambda: slots.loads)


def _select_kernels(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> KernelOps:
    kernels = select_kernels(config.device.kernels, device, dtype, config.quantization.quantization)
    if kernels.linear is upcast_linear:
        log.info("this CPU has no native %s matmul: projections upcast to float32 (weights stay %s)", dtype, dtype)
    if config.quantization.quantize_lm_head and kernels.int8_linear is dequant_linear:
        log.warning("quantize_lm_head: this CPU has no int8 matmul kernel for %s activations, so the int8 "
                    "lm_head is dequantized every step: slower than a float one", dtype)
    return kernels


def _warm_up(config: EngineConfig, model: CausalLM, kv_caches: list, kernels: KernelOps, scratch: torch.Tensor,
             max_model_len: int, device: torch.device, page_table: torch.Tensor | None) -> float:
    """Every Triton variant compiled now, not in the middle of serving (server.engine.warmup); its seconds."""
    seconds = warm_up(model, kv_caches, kernels, scratch, block_size=config.cache.block_size,
                      max_lora_rank=config.lora.max_lora_rank,
                      max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                      max_model_len=max_model_len, device=device, page_table=page_table)
    if seconds:
        log.info("compiled every kernel variant in %.1f s", seconds)
    return seconds


def _capture_decode_graphs(config: EngineConfig, device: torch.device, kernels: KernelOps, runner: ModelRunner,
                           max_loras: int, max_model_len: int) -> None:
    """Decode steps of up to the largest batch the scheduler forms replay a captured graph (CUDA, Triton
    kernels, unless enforce_eager). Not with the torch kernels: their padded LoRA gathers every row's
    weights (kernels.lora_cpu), which a graph would keep for good (~1 GB at Llama-3-8B widths, 256 rows)."""
    # Not for an MoE model: its routing sizes each expert's matmul on the host, step by step. Not with
    # KV layer groups (server.engine.kv_groups): the padded buffers hold one block table per row. With
    # Medusa heads the graphs keep the last layer's rows, and the heads run eagerly after each step.
    if (device.type == "cuda" and kernels.name == "triton" and not config.device.enforce_eager
            and not runner.model.cfg.is_moe and runner.kv_groups is None):
        rows = min(config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
        runner.use_padded_decode(max_loras, rows, max_model_len, *verify_shapes(config, device, rows)).capture()


def verify_shapes(config: EngineConfig, device: torch.device, rows: int) -> tuple[tuple[int, ...], int]:
    """(tokens per row, most rows) of the verify steps padded like decode (server.engine.decode_graphs):
    each k + 1 up to the configured k's (adaptive k shrinks it), of fewer sequences than the batch size at
    which no step speculates; none without speculative decoding."""
    spec = resolve_disable_by_batch_size(config.speculative_config, device.type)
    if spec is None:
        return (), 0
    return tuple(range(2, spec.num_speculative_tokens + 2)), min(rows, spec.disable_by_batch_size - 1)
