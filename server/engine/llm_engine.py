"""The engine: requests in, tokens out, one `step()` at a time (schedule -> run -> postprocess)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from adapters.format import LoraAdapter, ModelShape
from adapters.host_tier import Fetch, HostTier
from kernels.cpu_linear import upcast_linear
from kernels.int4_weights import DEFAULT_GROUP_SIZE
from kernels.int8_weights import dequant_linear
from server.engine.async_step import AsyncScheduling
from server.engine.block_manager import BlockManager
from server.engine.config import EngineConfig, ModelConfig
from server.engine.context_len import choose_max_model_len, model_limit
from server.engine.cuda_device import thread_binder
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.grammar import GrammarError, Grammars
from server.engine.grammar_mask import GrammarMask
from server.engine.kernel_choice import select_kernels
from server.engine.kv_cache import allocate_kv_cache, allocate_lora_slots
from server.engine.kv_cache_dtype import resolve_kv_cache_dtype
from server.engine.lora.dora_precompute import DoraPrecompute
from server.engine.mask_lane import MaskBudget
from server.engine.lora.dora_scale_cache import ScaleStore
from server.engine.lora.dora_scales import DoraScales
from server.engine.lora.slot_budget import free_device_bytes, resolve_max_loras
from server.engine.lora.slots import LoraSlots
from server.engine.model import CausalLM
from server.engine.model_runner import ModelRunner
from server.engine.postprocess import OutputProcessing
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import PREFETCH_WINDOW, Scheduler, SchedulerConfig
from server.engine.sequence import RequestOutput, Sequence, SequenceGroup
from server.engine.stop import StopChecker
from server.engine.tokenizer_loader import load_tokenizer
from server.engine.warmup import warm_up
from server.engine.weights import load_weights

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot serve as asked (too long, unknown adapter, bad token ids)."""


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    adapters_registered: int  # host tier: parsed adapters in host memory
    adapters_resident: int  # device tier: adapters in slots
    adapter_loads: int  # device tier: copies into a slot
    num_preemptions: int
    host_bytes_used: int = 0
    host_budget_bytes: int | None = None
    host_hits: int = 0
    host_misses: int = 0
    host_loads: int = 0
    host_load_failures: int = 0
    host_evictions: int = 0
    adapters_loading: int = 0
    adapters_parked: int = 0  # host tier: loaded, waiting for unpinned room (outside the budget)
    host_parked_bytes: int = 0
    device_hits: int = 0
    device_evictions: int = 0
    # Prefix cache (server.engine.prefix_cache). Tokens counted at each admission, readmissions after
    # preemption included; hit rate = prefix_hit_tokens / prefix_queries_tokens.
    prefix_cache_enabled: bool = False
    prefix_queries_tokens: int = 0  # tokens of the sequences looked up
    prefix_hit_tokens: int = 0  # of those, tokens whose KV came from the cache
    prefix_cached_blocks: int = 0  # KV blocks indexed in the cache (in use or not)
    prefix_cached_free_blocks: int = 0  # of those, blocks no request holds: evictable, counted as free
    # Decode CUDA graphs (server.engine.decode_graphs): captured at start-up unless enforce_eager or a CPU.
    cuda_graphs: int = 0  # graphs captured
    graph_replays: int = 0  # decode steps that replayed one
    graph_capture_seconds: float = 0.0
    graph_capture_bytes: int = 0
    # Async scheduling (server.engine.async_step): steps run on its worker, those of them scheduled while
    # the step before ran, and their rows discarded (the request ended or was aborted first).
    async_steps: int = 0
    async_steps_ahead: int = 0
    async_rows_discarded: int = 0
    # Structured output (server.engine.grammar): requests admitted with a constraint, and the
    # compiled-grammar cache's counters.
    constrained_requests: int = 0
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_failures: int = 0
    grammars_cached: int = 0
    running_adapters: frozenset[str] = frozenset()  # adapter versions of the running requests
    waiting_adapters: frozenset[str] = frozenset()  # adapter versions of the waiting requests


class LLMEngine(OutputProcessing):
    """`adapter_source`, when given, loads adapter versions on demand (e.g. from the Redis registry);
    it runs on background threads, so it may block. `dora_scale_store` keeps DoRA adapters' scales per
    version and base (server.engine.lora.dora_scale_cache; e.g. adapters.dora_scale_store)."""

    def __init__(self, config: EngineConfig, adapter_source: Fetch | None = None,
                 dora_scale_store: ScaleStore | None = None) -> None:
        self.config = config
        mcfg = ModelConfig.from_dir(config.model)
        self.model_config = mcfg
        self.device = config.resolve_device()
        # Every thread that touches CUDA makes the engine's device current (server.engine.cuda_device).
        self.bind_thread = thread_binder(self.device)
        self.bind_thread()
        self.dtype = config.resolve_dtype(mcfg, self.device)
        config.check_quantization(self.device, self.dtype)
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)  # refused before loading
        if self.device.type == "cpu" and (threads := config.resolve_cpu_threads()) is not None:
            torch.set_num_threads(threads)  # process-wide: the engine owns its process
        # Until the KV pool is sized, the longest context the model allows (or the one asked for).
        limit = model_limit(mcfg, config.max_model_len)
        max_len = config.max_model_len or limit
        self.tokenizer = load_tokenizer(config.model)
        eos = set(mcfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.adapter_shape = ModelShape(
            num_layers=mcfg.num_layers,
            hidden_size=mcfg.hidden_size,
            q_size=mcfg.q_size,
            kv_size=mcfg.kv_size,
            intermediate_size=mcfg.intermediate_size,
            vocab_size=mcfg.vocab_size,
        )

        weights = load_weights(config.model, mcfg, self.dtype, self.device, config.quantization,
                               config.int4_group_size, config.require_gptq_checkpoint)
        # Slots come before the KV pool: with max_loras unset, a share of what the weights left (CUDA).
        self.max_loras, why = resolve_max_loras(config.max_loras, mcfg, config.max_lora_rank, self.dtype,
                                                free_device_bytes(self.device))
        log.info("%s", why)
        lora_layers = allocate_lora_slots(mcfg, self.max_loras, config.max_lora_rank, self.dtype, self.device)
        self.model = CausalLM(mcfg, weights, lora_layers, max_len,  # frees the unfused projections
                              config.max_num_batched_tokens, config.quantization, config.quantize_lm_head,
                              config.int4_group_size or DEFAULT_GROUP_SIZE)
        del weights
        # Everything else on the device is allocated before the KV pool is sized from what is left.
        self.lora_slots = LoraSlots(lora_layers, self.max_loras, DoraScales.of_model(self.model), dora_scale_store)
        scratch = torch.empty(
            3, config.max_num_batched_tokens, config.max_lora_rank, dtype=self.dtype, device=self.device
        )
        kv_caches, self.kv_pool = allocate_kv_cache(mcfg, config, max_len, self.dtype, self.device, kv_dtype)
        num_blocks = self.kv_pool.blocks
        context = choose_max_model_len(config.max_model_len, limit, num_blocks, config.block_size)
        self.max_model_len = context.max_model_len
        log.info("%s", context.reason)
        self.blocks = BlockManager(num_blocks, config.block_size)
        # Parking places for finished loads match the scheduler's prefetch window: every adapter it
        # prefetches can wait, loaded, for room, instead of being fetched again.
        self.host = HostTier(adapter_source, config.max_cpu_lora_bytes, pin_memory=self.device.type == "cuda",
                             max_parked=PREFETCH_WINDOW, dtype=self.dtype, init_thread=self.bind_thread,
                             prepare=self.lora_slots.prepare if self.device.type == "cpu" else None)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            config.max_prefill_tokens_while_decoding), self.blocks, self.lora_slots, self.host)
        self.kernels = select_kernels(config.kernels, self.device, self.dtype, config.quantization)
        if self.kernels.linear is upcast_linear:
            log.info("this CPU has no native %s matmul: projections upcast to float32 (weights stay %s)",
                     self.dtype, self.dtype)
        if config.quantize_lm_head and self.kernels.int8_linear is dequant_linear:
            log.warning("quantize_lm_head: this CPU has no int8 matmul kernel for %s activations, so the int8 "
                        "lm_head is dequantized every step: slower than a float one", self.dtype)
        # Structured output: the grammar vocabulary is the tokenizer's, as wide as the logits at least.
        budget = MaskBudget(config.max_mask_fill_seconds, config.max_mask_seconds_per_request)
        self.grammars = Grammars(self.tokenizer, mcfg.vocab_size, self.eos_token_ids, mask_budget=budget)
        self.runner = ModelRunner(
            self.model, kv_caches, self.kernels, config.block_size, scratch, self.lora_slots.slot_ranks,
            self.lora_slots.rank_table, self.device,
            config.seed, GrammarMask(self.grammars.info.vocab_size), self.lora_slots.slot_dora,
        )
        self.constrained_requests = 0
        # Every Triton variant is compiled now, not in the middle of serving (server.engine.warmup).
        self.warmup_seconds = warm_up(
            self.model, kv_caches, self.kernels, scratch, block_size=config.block_size,
            max_lora_rank=config.max_lora_rank, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, device=self.device,
        )
        if self.warmup_seconds:
            log.info("compiled every kernel variant in %.1f s", self.warmup_seconds)
        # DoRA scales at adapter intake; on a CPU engine with a store, the base identity they are keyed by now.
        self.dora_precompute = DoraPrecompute(self.host, self.lora_slots.dora_cache)
        if self.device.type == "cuda" and self.kernels.name == "triton" and not config.enforce_eager:
            # Decode steps of up to the largest batch the scheduler forms replay a captured graph. Not with
            # the torch kernels: their padded LoRA gathers every row's weights (kernels.lora_cpu), which a
            # graph would keep for good (~1 GB at Llama-3-8B widths and 256 rows).
            rows = min(config.max_num_seqs, config.max_num_batched_tokens)
            self.runner.use_padded_decode(self.max_loras, rows, self.max_model_len).capture()
        # --async-scheduling: forwards on a worker thread while this one prepares the next step
        # (server.engine.async_step); None: every step synchronous.
        self.overlap = AsyncScheduling(self.runner, self.scheduler, self.blocks, self.max_model_len,
                                       self.bind_thread) if config.async_scheduling else None
        self.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.seqs: dict[str, Sequence] = {}
        self.aborted: list[Sequence] = []
        self.arrivals = 0
        self.set_prefix_cache_policy(getattr(config, "enable_prefix_caching", True),
                                     getattr(config, "share_base_prefix_cache", False))

    # ---- adapters (keyed by immutable version id) ----
    def add_adapter(self, version_id: str, adapter: LoraAdapter) -> None:
        """Preload an adapter version into the host tier; it stays until removed."""
        if adapter.rank > self.config.max_lora_rank:
            raise RequestError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self.config.max_lora_rank}")
        self.host.add(version_id, adapter)
        self.scheduler.prefix_cache.restore(version_id)

    def remove_adapter(self, version_id: str) -> None:
        """A deleted or replaced version leaves every tier once no request uses it; its cached KV
        blocks leave the prefix cache at once."""
        self.host.remove(version_id)
        self.lora_slots.remove(version_id)
        self.scheduler.prefix_cache.retire(version_id)

    # ---- prefix cache ----
    def set_prefix_cache_policy(self, enabled: bool = True, share_base_across_tenants: bool = False) -> None:
        """Turn prefix caching on or off, and allow base-model blocks to be reused across tenants
        (never adapter blocks). Sharing lets a tenant tell, from time to first token, whether another
        sent a prompt; off by default. A change drops everything cached."""
        if self.scheduler.prefix_cache.set_policy(enabled, share_base_across_tenants):
            for first in self.seqs.values():
                for seq in first.group.seqs:
                    seq.block_hashes.clear()  # hashed under the old keys: recomputed when needed

    def has_adapter(self, version_id: str) -> bool:
        return self.host.ready(version_id)

    # ---- requests ----
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        return [int(t) for t in prompt]

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        version_id: str | None = None,
        tenant: str | None = None,
        priority: int = 0,
        tenant_weight: float | None = None,
        cache_salt: str | None = None,
        grammar=None,
    ) -> None:
        """Queue a request. `tenant_weight` (the tenant's fair-share weight) updates the scheduler's copy.

        `grammar` is params.structured_outputs compiled already (the server compiles off this
        thread, under a deadline); without it a constraint is compiled here, from the cache if it can.

        Lower `priority` values are served first within a tenant. Only requests with the same tenant
        and `cache_salt` (and adapter version) reuse each other's cached prompt blocks.
        """
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RequestError("cache_salt must be a string")
        ids = self.tokenize(prompt)
        self.validate(ids, params, version_id)
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in use")
        stop_ids: tuple[int, ...] = ()
        if params.min_tokens:
            held = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            stop_ids = tuple(sorted(t for t in held if t < self.model_config.vocab_size))
        if params.structured_outputs is not None and grammar is None:
            try:
                grammar = self.grammars.compile(params.structured_outputs)
            except GrammarError as e:
                raise RequestError(str(e)) from None
        group = SequenceGroup(request_id, params.prompt_logprobs is not None, stop_ids)
        for index in range(params.n):  # choices 1.. wait, unscheduled, for choice 0's prefill
            seq = Sequence(request_id, ids, params, version_id, self.arrivals, tenant, priority, index, group,
                           cache_salt)
            seq.detok_state = self.detokenizer.new_state(start=len(ids))
            seq.stop = StopChecker(params.stop)
            if grammar is not None:
                # One per choice: each goes its own way; its first mask is filled from now, off the step.
                seq.grammar = self.grammars.choice_matcher(grammar, params.structured_outputs.kind,
                                                           group.seqs[0].grammar)
        self.constrained_requests += grammar is not None
        self.arrivals += 1
        self.seqs[request_id] = group.seqs[0]
        if tenant_weight is not None:
            self.scheduler.waiting.set_weight(tenant, tenant_weight)
        self.scheduler.add(group.seqs[0])

    def validate(self, ids: list[int], params: SamplingParams, version_id: str | None) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}"
            )
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})")
        if params.n > self.config.max_num_seqs:
            raise RequestError(f"n ({params.n}) exceeds max_num_seqs {self.config.max_num_seqs}")
        if version_id is not None and not self.host.can_serve(version_id):
            raise RequestError(f"adapter {version_id!r} is not loaded")

    def abort_request(self, request_id: str) -> None:
        """Abort every unfinished choice of the request."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        for choice in seq.group.seqs:
            if not choice.finished:
                self.scheduler.finish(choice)
                choice.finish_reason = "abort"
                self.aborted.append(choice)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.aborted) or (self.overlap is not None
                                                                         and self.overlap.in_flight)

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        overlap = self.overlap
        if overlap is None or not overlap.in_flight:
            batch = self.scheduler.schedule()
            if batch.empty and not batch.failed and not self.aborted:
                self.host.wait_for_load(0.005)  # only adapter loads are pending: wait for one, don't spin
                return []
            if overlap is None or not overlap.launch(batch):
                results = self.runner.run(batch) if not batch.empty else {}
                return self.postprocess(batch, results)
        # Async scheduling: while step N runs on the worker, step N+1 is scheduled and prepared and queued
        # behind it where it can be; then N's tokens are post-processed while N+1 runs.
        overlap.launch_ahead()
        return self.postprocess(*overlap.collect())

    def stats(self) -> EngineStats:
        prefix = self.scheduler.prefix_cache
        padded = self.runner.padded
        captured = padded.capture_stats if padded is not None else None
        grammars = self.grammars.stats()
        running_adapters, waiting_adapters = self.scheduler.adapters_in_use()
        overlap = self.overlap.stats() if self.overlap is not None else None
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.blocks.num_used_blocks,
            kv_blocks_total=self.blocks.num_blocks,
            adapters_registered=len(self.host.entries),
            adapters_resident=self.lora_slots.num_resident,
            adapter_loads=self.lora_slots.loads,
            num_preemptions=self.scheduler.num_preemptions,
            host_bytes_used=self.host.bytes_used,
            host_budget_bytes=self.host.budget_bytes,
            host_hits=self.host.stats.hits,
            host_misses=self.host.stats.misses,
            host_loads=self.host.stats.loads,
            host_load_failures=self.host.stats.load_failures,
            host_evictions=self.host.stats.evictions,
            adapters_loading=len(self.host.loading),
            adapters_parked=len(self.host.parked),
            host_parked_bytes=self.host.parked_bytes,
            device_hits=self.lora_slots.hits,
            device_evictions=self.lora_slots.evictions,
            prefix_cache_enabled=prefix.enabled,
            prefix_queries_tokens=prefix.queries_tokens,
            prefix_hit_tokens=prefix.hit_tokens,
            prefix_cached_blocks=self.blocks.num_cached_blocks,
            prefix_cached_free_blocks=self.blocks.num_evictable_blocks,
            cuda_graphs=captured.graphs if captured else 0,
            graph_replays=padded.replays if padded is not None else 0,
            graph_capture_seconds=captured.seconds if captured else 0.0,
            graph_capture_bytes=captured.bytes if captured else 0,
            async_steps=overlap.launched if overlap else 0,
            async_steps_ahead=overlap.ahead if overlap else 0,
            async_rows_discarded=overlap.discarded if overlap else 0,
            constrained_requests=self.constrained_requests,
            grammar_compiles=grammars.compiles,
            grammar_cache_hits=grammars.cache_hits,
            grammar_compile_seconds=grammars.compile_seconds,
            grammar_failures=grammars.failures,
            grammars_cached=grammars.cached,
            running_adapters=running_adapters,
            waiting_adapters=waiting_adapters,
        )

    def shutdown(self) -> None:
        if self.overlap is not None:
            self.overlap.shutdown()
        self.host.shutdown()
        self.dora_precompute.shutdown()
        self.grammars.lane.shutdown()
