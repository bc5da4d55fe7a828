"""The engine: requests in, tokens out, one `step()` at a time (schedule -> run -> postprocess)."""
from __future__ import annotations

import time
from functools import cached_property

from adapters.draft_lora import NO_DRAFT_MODEL
from adapters.format import LoraAdapter
from adapters.host_tier import Fetch
from server.engine.async_step import AsyncStats
from server.engine.choice_abort import ChoiceAbort
from server.engine.config import EngineConfig
from server.engine.decode_graphs import DecodeGraphStats
from server.engine.engine_startup import build_engine_parts
from server.engine.engine_stats import EngineStats, StepCounts
from server.engine.grammar import GrammarError
from server.engine.lora.dora_scale_cache import ScaleStore
from server.engine.lora.slots import PinLimitError
from server.engine.model_runner import SeqResult
from server.engine.output_text import IncrementalDetokenizer
from server.engine.scheduler import ScheduledBatch
from server.engine.sequence import RequestOutput, SamplingParams, Sequence, SequenceGroup
from server.engine.step_trace import StepRecord, StepTrace, rows_of


class RequestError(ValueError):
    """A request the engine cannot serve as asked (too long, unknown adapter, bad token ids)."""


class LLMEngine:
    """`adapter_source`, when given, loads adapter versions on demand (e.g. from the Redis registry);
    it runs on background threads, so it may block. `dora_scale_store` keeps DoRA adapters' scales per
    version and base (server.engine.lora.dora_scale_cache; e.g. adapters.dora_scale_store)."""

    def __init__(self, config: EngineConfig, adapter_source: Fetch | None = None,
                 dora_scale_store: ScaleStore | None = None) -> None:
        parts = build_engine_parts(config, adapter_source, dora_scale_store)  # server.engine.engine_startup
        self.config = parts.config
        self.model_config = parts.model_config
        self.device = parts.device
        self.bind_thread = parts.bind_thread
        self.dtype = parts.dtype
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.adapter_shape = parts.adapter_shape
        self.draft_adapter_shape = parts.draft_adapter_shape
        self.max_loras = parts.max_loras
        self.model = parts.model
        self.lora_slots = parts.lora_slots
        self.kv_pool = parts.kv_pool
        self.max_model_len = parts.max_model_len
        self.blocks = parts.blocks
        self.host = parts.host
        self.scheduler = parts.scheduler
        self.kernels = parts.kernels
        self.grammars = parts.grammars
        self.runner = parts.runner
        self.warmup_seconds = parts.warmup_seconds
        self.dora_precompute = parts.dora_precompute
        self.overlap = parts.overlap
        self.output_processor = parts.output_processor
        self.step_fn = self.step_overlapped if self.overlap is not None else self.step_plain
        self.trace = StepTrace.from_env()  # LORAPLEX_STEP_TRACE: a diagnostic per-step record (plain steps)
        self.constrained_requests = 0
        self.arrivals = 0
        self.plain_steps = 0  # batches run by _run (the overlapped ones: self.overlap's num_launched)
        self.set_prefix_cache_policy(config.cache.enable_prefix_caching,
                                     config.cache.share_base_prefix_cache)

    @property
    def seqs(self) -> dict[str, Sequence]:
        """The requests in flight: request id -> its choice 0 (kept by the output processor)."""
        return self.output_processor.seqs

    # ---- adapters (keyed by immutable version id) ----
    def add_adapter(self, version_id: str, adapter: LoraAdapter) -> None:
        """Preload an adapter version into the host tier; it stays until removed."""
        if adapter.rank > self.config.lora.max_lora_rank:
            raise RequestError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self.config.lora.max_lora_rank}")
        if getattr(adapter, "vocab", None) is not None and self.config.parallel.tensor_parallel_size > 1:
            raise RequestError(f"adapters with parts of embed_tokens or lm_head are not served with "
                               f"--tensor-parallel-size {self.config.parallel.tensor_parallel_size} yet")
        heads = getattr(adapter, "medusa", None)
        spec = self.config.speculative_config
        if heads is not None and spec is not None and spec.method == "medusa" and \
                heads.num_heads < spec.num_speculative_tokens:
            raise RequestError(f"the adapter's medusa heads num_heads {heads.num_heads} is fewer than "
                               f"num_speculative_tokens {spec.num_speculative_tokens}")
        if getattr(adapter, "draft", None) is not None and self.draft_adapter_shape is None:
            raise RequestError(NO_DRAFT_MODEL)
        self.host.add(version_id, adapter)
        self.scheduler.prefix_cache.restore(version_id)

    def remove_adapter(self, version_id: str) -> None:
        """A deleted or replaced version leaves every tier once no request uses it; its cached KV
        blocks leave the prefix cache at once."""
        self.release_adapter_memory(version_id)
        self.scheduler.prefix_cache.retire(version_id)

    def release_adapter_memory(self, version_id: str) -> None:
        """vLLM's unload: the version leaves the device slots and the host tier once no running request
        uses it, and stays valid: the next request loads it again, and its cached prefix KV still holds
        (the same version id is the same weights)."""
        self.host.remove(version_id)
        self.lora_slots.remove(version_id)

    def pin_adapter(self, version_id: str, tenant: str | None) -> bool:
        """Keep the version on the device once loaded (never evicted) until unpinned or removed; False,
        pinning nothing, when `tenant` already pins max_pinned_adapters_per_tenant versions."""
        try:
            self.lora_slots.pin(version_id, tenant)
        except PinLimitError:
            return False
        return True

    def unpin_adapter(self, version_id: str) -> bool:
        """The version may be evicted again; whether it was pinned."""
        return self.lora_slots.unpin(version_id)

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
            if grammar is not None:
                # One per choice: each goes its own way; its first mask is filled from now, off the step.
                seq.grammar = self.grammars.choice_matcher(grammar, params.structured_outputs.kind,
                                                           group.seqs[0].grammar, tenant, self.scheduler.grammar_drafts)
        self.constrained_requests += grammar is not None
        self.arrivals += 1
        self.output_processor.add(group.seqs[0])
        if tenant_weight is not None:
            self.scheduler.waiting.set_weight(tenant, tenant_weight)
        self.scheduler.add(group.seqs[0])

    @cached_property
    def detokenizer(self) -> IncrementalDetokenizer:
        """For a front end in this process (the in-process client, the LLM API): built on first use, so
        an engine core, whose outputs carry no text, never builds the vocabulary's byte table."""
        return IncrementalDetokenizer(self.tokenizer)

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
        if params.n > self.config.scheduler.max_num_seqs:
            raise RequestError(f"n ({params.n}) exceeds max_num_seqs {self.config.scheduler.max_num_seqs}")
        if version_id is not None and not self.host.can_serve(version_id):
            raise RequestError(f"adapter {version_id!r} is not loaded")

    def abort_request(self, request_id: str) -> None:
        """Abort every unfinished choice of the request."""
        self.output_processor.abort(request_id)

    def abort_choice(self, abort: ChoiceAbort) -> None:
        """The front end ended one choice (a stop string): it stops, its siblings run on, and its tenant is
        charged only the tokens its client was given (server.engine.choice_abort)."""
        self.output_processor.abort_choice(abort)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.output_processor.aborted) or (
            self.overlap is not None and self.overlap.in_flight)

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> run -> postprocess; overlapped under --async-scheduling (the
        variant is chosen once, at construction)."""
        return self.step_fn()

    def step_plain(self) -> list[RequestOutput]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if self._idle(batch):
            return []
        if self.trace is not None:
            return self._traced(start, batch)
        outputs = self.output_processor.postprocess(batch, self._run(batch))
        # The step as a decoding stream sees it, timed around work that already waited for its tokens (the
        # latency-aware prefill cap learns from it; overlapped steps are not timed: the static cap holds).
        self.scheduler.observe(time.perf_counter() - start, batch)
        return outputs

    def _traced(self, start: float, batch: ScheduledBatch) -> list[RequestOutput]:
        """step_plain's run and post-processing, each timed into the step trace."""
        scheduled = time.perf_counter()
        rows = rows_of(batch)
        results = self._run(batch)
        ran = time.perf_counter()
        outputs = self.output_processor.postprocess(batch, results)
        end = time.perf_counter()
        self.scheduler.observe(end - start, batch)
        self.trace.write(StepRecord(start, scheduled - start, ran - scheduled, end - ran,
                                    self.scheduler.last_prompt_budget, rows))
        return outputs

    def step_overlapped(self) -> list[RequestOutput]:
        """While step N runs on the worker, step N+1 is scheduled and prepared and queued behind it where
        it can be; then N's tokens are post-processed while N+1 runs (server.engine.async_step)."""
        overlap = self.overlap
        if not overlap.in_flight:
            batch = self.scheduler.schedule()
            if self._idle(batch):
                return []
            if not overlap.launch(batch):  # a step that cannot overlap runs as the plain step would
                return self.output_processor.postprocess(batch, self._run(batch))
        overlap.launch_ahead()
        return self.output_processor.postprocess(*overlap.collect())

    def _idle(self, batch: ScheduledBatch) -> bool:
        """Nothing to run or report: only adapter loads are pending, so wait for one rather than spin."""
        if batch.empty and not batch.failed and not self.output_processor.aborted:
            self.host.wait_for_load(0.005)
            return True
        return False

    def _run(self, batch: ScheduledBatch) -> dict[int, SeqResult]:
        if batch.empty:
            return {}
        self.plain_steps += 1
        return self.runner.run(batch)

    def step_counts(self) -> StepCounts:
        """Steps run so far and how many replayed a decode graph: two counters, no snapshot (EngineStats)."""
        padded = self.runner.padded
        launched = self.overlap.num_launched if self.overlap is not None else 0
        return StepCounts(self.plain_steps + launched, padded.replays if padded is not None else 0)

    def stats(self) -> EngineStats:
        padded = self.runner.padded
        return EngineStats(
            scheduler=self.scheduler.stats(),
            kv_blocks=self.blocks.stats(),
            prefix_cache=self.scheduler.prefix_cache.stats(),
            host=self.host.snapshot(),
            slots=self.lora_slots.stats(),
            decode_graphs=padded.stats() if padded is not None else DecodeGraphStats(),
            async_scheduling=self.overlap.stats() if self.overlap is not None else AsyncStats(),
            grammar=self.grammars.stats(),
            constrained_requests=self.constrained_requests,
            speculative=self.scheduler.spec_counters.snapshot(),
        )

    def shutdown(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.overlap is not None:
            self.overlap.shutdown()
        self.runner.shutdown()
        self.host.shutdown()
        self.dora_precompute.shutdown()
        self.grammars.lane.shutdown()
