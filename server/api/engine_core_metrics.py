"""Per-engine-core series for --data-parallel-size, labelled `engine` as vLLM labels its engines' series.

The vllm: series stay one per server (the cores summed): a gateway picks a pod, and its scorers read
the pod's queue, KV and adapter lists. These say how the load and the adapters spread over the cores
inside it. A single engine has no cores to report and these families stay empty.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from server.engine.protocol import EngineCoreReport

LABELS = ["model_name", "engine"]


class EngineCoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.up = Gauge("loraplex_engine_core_up", "1 while the engine core serves, 0 while it is dead or "
                        "restarting", LABELS, registry=r)
        self.restarts = Gauge("loraplex_engine_core_restarts", "Restarts of the engine core since start", LABELS,
                              registry=r)
        self.routed = Gauge("loraplex_engine_core_routed_requests", "Requests routed to the engine core since "
                            "start", LABELS, registry=r)
        self.running = Gauge("loraplex_engine_core_requests_running", "Requests in the core's running batch",
                             LABELS, registry=r)
        self.waiting = Gauge("loraplex_engine_core_requests_waiting", "Requests waiting in the core's queue",
                             LABELS, registry=r)
        self.kv_usage = Gauge("loraplex_engine_core_kv_cache_usage_perc", "The core's KV cache usage, 1 = full",
                              LABELS, registry=r)
        self.resident = Gauge("loraplex_engine_core_lora_adapters_device", "Adapters in the core's device slots",
                              LABELS, registry=r)
        self.slots = Gauge("loraplex_engine_core_lora_slots", "The core's device slots (--max-loras)", LABELS,
                           registry=r)
        self.device_hits = Gauge("loraplex_engine_core_device_hits", "Requests whose adapter was in one of the "
                                 "core's slots already", LABELS, registry=r)
        self.device_loads = Gauge("loraplex_engine_core_device_loads", "Adapter loads into the core's slots "
                                  "(a device miss)", LABELS, registry=r)

    def observe(self, cores: list[EngineCoreReport], model: str) -> None:
        for core in cores:
            labels = (model, str(core.index))
            s = core.snapshot.stats
            for gauge, value in ((self.up, core.healthy), (self.restarts, core.restarts), (self.routed, core.routed),
                                 (self.running, s.scheduler.running), (self.waiting, s.scheduler.waiting),
                                 (self.kv_usage, s.kv_blocks.used / s.kv_blocks.total if s.kv_blocks.total else 0.0),
                                 (self.resident, s.slots.resident), (self.slots, core.max_loras),
                                 (self.device_hits, s.slots.hits), (self.device_loads, s.slots.loads)):
                gauge.labels(*labels).set(float(value))
