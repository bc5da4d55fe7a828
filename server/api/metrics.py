"""Prometheus metrics on a per-app CollectorRegistry (never the global one, so two
apps in one process, as in the tests, keep separate counts)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from server.api.engine_core_metrics import EngineCoreMetrics
from server.api.store_tally import StoreTally
from server.api.vllm_metrics import VllmMetrics
from server.engine.protocol import EngineStats, LoadTimes

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def hit_rate(hits: int, misses: int) -> float | None:
    """None before the first lookup."""
    return hits / (hits + misses) if hits + misses else None


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("loraplex_requests", "Generation requests by tenant and outcome",
                                ["tenant", "endpoint", "outcome"], registry=r)
        self.tokens = Counter("loraplex_tokens", "Tokens by tenant and kind (prompt, completion)",
                              ["tenant", "kind"], registry=r)
        self.ttft = Histogram("loraplex_time_to_first_token_seconds",
                              "From request arrival to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("loraplex_inter_token_latency_seconds",
                             "Between consecutive outputs of one request, per token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("loraplex_queue_depth", "Requests waiting to be scheduled", registry=r)
        self.running = Gauge("loraplex_running_batch_size", "Requests in the running batch", registry=r)
        self.kv_used = Gauge("loraplex_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("loraplex_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        # With --unified-memory the pool's units (KV blocks' bytes) are shared with adapter pages; without, the
        # adapter use is 0. The four uses sum to loraplex_kv_blocks_total.
        self.pool_units = Gauge("loraplex_memory_pool_units", "Units of the KV pool (one KV block's bytes) by use: "
                                "kv (sequences' blocks), adapter (pages of resident adapters, --unified-memory), "
                                "cached (prefix blocks nobody holds, evictable), free", ["use"], registry=r)
        self.adapters_loaded = Gauge("loraplex_adapters_loaded", "Adapters registered in the engine",
                                     registry=r)
        self.adapters_resident = Gauge("loraplex_adapters_resident",
                                       "Adapters in accelerator slots", registry=r)
        self.preemptions = Gauge("loraplex_preemptions", "Preemptions since start", registry=r)
        # Adapter paging, per tier (host = parsed in host memory, device = accelerator slots).
        # Cumulative counts are gauges set from the engine's own counters at scrape time.
        self.tier_hits = Gauge("loraplex_adapter_tier_hits", "Requests whose adapter was already in the tier",
                               ["tier"], registry=r)
        self.tier_misses = Gauge("loraplex_adapter_tier_misses", "Requests that had to load their adapter into the tier",
                                 ["tier"], registry=r)
        self.tier_evictions = Gauge("loraplex_adapter_tier_evictions", "Adapters evicted from the tier",
                                    ["tier"], registry=r)
        self.tier_resident = Gauge("loraplex_adapter_tier_resident", "Adapters resident in the tier",
                                   ["tier"], registry=r)
        self.tier_hit_rate = Gauge("loraplex_adapter_tier_hit_rate", "Hits / (hits + misses) since start; 0 before "
                                   "the first", ["tier"], registry=r)
        self.tier_bytes = Gauge("loraplex_adapter_tier_bytes", "Bytes of adapters in the tier: host (parsed, in the "
                                "serving dtype), store (Redis, as stored; the fleet's, counted at most once a minute)",
                                ["tier"], registry=r)
        self.host_bytes = Gauge("loraplex_adapter_host_bytes", "Bytes of adapters in the host tier", registry=r)
        self.parked = Gauge("loraplex_adapter_host_parked", "Loaded adapters waiting for unpinned host room",
                            registry=r)
        self.parked_bytes = Gauge("loraplex_adapter_host_parked_bytes", "Bytes of parked adapters", registry=r)
        self.loading = Gauge("loraplex_adapter_loads_in_flight", "Adapter loads from Redis under way", registry=r)
        # Prefix cache: cumulative token counts from the engine, set at scrape time (as the tier counters).
        self.prefix_queries = Gauge("loraplex_prefix_cache_queries_tokens",
                                    "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Gauge("loraplex_prefix_cache_hits_tokens",
                                 "Prompt tokens served from the prefix cache", registry=r)
        self.prefix_free = Gauge("loraplex_prefix_cache_cached_free_blocks",
                                 "KV blocks cached but held by no request (evictable, counted as free)", registry=r)
        self.graph_replays = Gauge("loraplex_graph_replays_total",
                                   "Decode steps that replayed a captured CUDA graph", registry=r)
        self.cuda_graphs = Gauge("loraplex_cuda_graphs", "Decode CUDA graphs captured at start-up",
                                 registry=r)
        self.async_ahead = Gauge("loraplex_async_steps_ahead_total",
                                 "Decode steps scheduled while the step before them ran (--async-scheduling)",
                                 registry=r)
        # Structured output: cumulative counts from the engine's grammar cache, set at scrape time.
        self.constrained = Gauge("loraplex_constrained_requests", "Requests admitted with a structured-output "
                                 "constraint", registry=r)
        self.grammar_compiles = Gauge("loraplex_grammar_compiles", "Structured-output grammars compiled",
                                      registry=r)
        self.grammar_cache_hits = Gauge("loraplex_grammar_cache_hits", "Constraints served from the compiled-"
                                        "grammar cache", registry=r)
        self.grammar_compile_seconds = Gauge("loraplex_grammar_compile_seconds", "Time spent compiling grammars",
                                             registry=r)
        self.grammar_failures = Gauge("loraplex_grammar_failures", "Constraints refused: malformed or past "
                                      "--max-grammar-compile-ms", registry=r)
        self.tool_requests = Counter("loraplex_tool_call_requests", "Chat requests that offered tools, by "
                                     "tool_choice mode (none, auto, required, named)", ["mode"], registry=r)
        self.load_failures = Gauge("loraplex_adapter_load_failures", "Adapter loads that failed", registry=r)
        self.load_time = Histogram("loraplex_adapter_load_seconds", "Redis -> host load (fetch, parse, pin)",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.auth_failures = Counter("loraplex_auth_failures",
                                     "Failed API-key checks: invalid (401) or throttled (429)", ["outcome"],
                                     registry=r)
        # Crash recovery (server.api.auth), set from its counters at scrape time.
        self.running_leases = Gauge("loraplex_running_leases", "Concurrency leases this replica beats", registry=r)
        self.leases_lost = Gauge("loraplex_leases_lost",
                                 "Running requests whose lease lapsed (this replica unheard for --lease-ttl)",
                                 registry=r)
        self.longest_beat_gap = Gauge("loraplex_lease_heartbeat_longest_gap_seconds",
                                      "Longest a running request's lease went unrenewed since start (it "
                                      "lapses past --lease-ttl)", registry=r)
        # An info metric (`loraplex_replica_info{replica=...} 1`) rather than a replica label on every
        # series: Prometheus already labels each scrape target, and a join on this one names it.
        self.replica = Info("loraplex_replica", "Which replica this is, and what it serves", registry=r)
        self.vllm = VllmMetrics(r)
        self.cores = EngineCoreMetrics(r)  # --data-parallel-size's cores, one `engine` label each

    def observe_engine(self, s: EngineStats) -> None:
        self.queue_depth.set(s.scheduler.waiting)
        self.running.set(s.scheduler.running)
        self.kv_used.set(s.kv_blocks.used)
        self.kv_total.set(s.kv_blocks.total)
        kv, cached = s.kv_blocks, s.prefix_cache.cached_free_blocks
        for use, units in (("kv", kv.used), ("adapter", kv.lent), ("cached", cached),
                           ("free", kv.total - kv.used - kv.lent - cached)):
            self.pool_units.labels(use).set(units)
        self.adapters_loaded.set(s.host.adapters)
        self.adapters_resident.set(s.slots.resident)
        self.preemptions.set(s.scheduler.preemptions)
        # A device miss is a load into a slot.
        for tier, hits, misses, evictions, resident in (
                ("host", s.host.hits, s.host.misses, s.host.evictions, s.host.adapters),
                ("device", s.slots.hits, s.slots.loads, s.slots.evictions, s.slots.resident)):
            self.tier_hits.labels(tier).set(hits)
            self.tier_misses.labels(tier).set(misses)
            self.tier_evictions.labels(tier).set(evictions)
            self.tier_resident.labels(tier).set(resident)
            self.tier_hit_rate.labels(tier).set(hit_rate(hits, misses) or 0.0)
        self.tier_bytes.labels("host").set(s.host.bytes_used)
        self.host_bytes.set(s.host.bytes_used)
        self.loading.set(s.host.loading)
        self.parked.set(s.host.parked)
        self.prefix_queries.set(s.prefix_cache.queried_tokens)
        self.prefix_hits.set(s.prefix_cache.hit_tokens)
        self.prefix_free.set(s.prefix_cache.cached_free_blocks)
        self.parked_bytes.set(s.host.parked_bytes)
        self.load_failures.set(s.host.load_failures)
        self.graph_replays.set(s.decode_graphs.replays)
        self.cuda_graphs.set(s.decode_graphs.graphs)
        self.async_ahead.set(s.async_scheduling.ahead)
        self.constrained.set(s.constrained_requests)
        self.grammar_compiles.set(s.grammar.compiles)
        self.grammar_cache_hits.set(s.grammar.cache_hits)
        self.grammar_compile_seconds.set(s.grammar.compile_seconds)
        self.grammar_failures.set(s.grammar.failures)

    def observe_store(self, tally: StoreTally | None) -> None:
        if tally is None:
            return  # never counted: Redis has failed since start
        self.tier_resident.labels("store").set(tally.adapters)
        self.tier_bytes.labels("store").set(tally.bytes)

    def observe_identity(self, replica: str, model: str, version: str) -> None:
        self.replica.info({"replica": replica, "model": model, "version": version})

    def observe_load_times(self, times: LoadTimes) -> None:
        """The engine's load durations since the last call (EngineClient.take_load_times) into the histograms."""
        for s in times.host:
            self.load_time.observe(s)
        self.vllm.observe_load_times(times)

    def render(self) -> bytes:
        return generate_latest(self.registry)
