"""The metrics LoRA-aware routers and autoscalers read, with vLLM's names and meanings (the Gateway
API Inference Extension's model-server protocol and the llm-d router's vllm engine config, KEDA rules
written for vLLM), beside ours, and the adapter residency below the device that vLLM has no tier for.

Adapters are named by their owner: `<tenant id>/<name>` for a tenant's (a tenant id is immutable, and
another tenant's adapter of the same name is another adapter), the bare name for the operator's
--lora-modules (global names, as in vLLM). They name tenants' adapters, so they sit behind the
metrics credential with the rest of /metrics.

`vllm:lora_requests_info` keeps vLLM's meaning, read from the scheduler's queues: running = the
adapters of requests in the running batch, waiting = the adapters of requests still queued (not a
copy of running). An adapter idle in a slot is in neither list: the router counts the running list
against `max_lora` to find a free slot, and an idle slot is free (evicted on demand); where adapters
sit is `vllm:lora_adapter_loaded`. Its `level` is where the adapter is: `gpu` (a device slot, on
whatever device serves), `cpu` (host memory). The store level (Redis) is not a series per adapter:
every registered adapter is there, the same for every replica, so it tells a router nothing and
would grow with the fleet on every replica."""
from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adapters.sharing import OPERATOR_OWNER
from server.engine.protocol import AdapterTiers, EngineInfo, EngineStats, LoadTimes, SpecDecodeStats

# Versions are immutable, so their labels can be remembered; the bound keeps a long-lived server's
# memory flat (a miss costs one Redis read).
_LABEL_CACHE = 4096
# Loads from Redis into host memory take milliseconds to seconds (fetch, parse, pin); copies into a
# device slot, tens of microseconds up.
_LOAD_BUCKETS = (0.00001, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0, 30.0)
# The tiers' names in vLLM's level label.
GPU, CPU = "gpu", "cpu"


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", ["model_name"],
                             registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", ["model_name"],
                             registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 1 = full (a fraction, as vLLM's)",
                              ["model_name"], registry=r)
        self.lora_info = Gauge("vllm:lora_requests_info", "Running and waiting adapters; the value is the "
                               "time of the last update", ["running_lora_adapters", "waiting_lora_adapters",
                                                           "max_lora"], registry=r)
        # The KV pool's shape, for the router's prefix-cache scorer (the protocol's BlockSize and
        # NumGPUBlocks, as label values of one info-style series, as vLLM exports them).
        self.cache_config = Gauge("vllm:cache_config_info", "The KV cache's configuration (in the labels)",
                                  ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
                                  registry=r)
        self.loaded = Gauge("vllm:lora_adapter_loaded", "1 for each adapter held in a tier: gpu (a device "
                            "slot) or cpu (host memory)", ["adapter_name", "level"], registry=r)
        self.gpu_loaded = Gauge("vllm:num_gpu_loaded_lora_adapters", "Adapters in device slots", ["model_name"],
                                registry=r)
        self.gpu_max = Gauge("vllm:max_gpu_lora_adapters", "Device slots for adapters (--max-loras)",
                             ["model_name"], registry=r)
        self.load_seconds = Histogram("vllm:lora_adapter_load_seconds", "Adapter load latency into a tier: cpu = "
                                      "Redis -> host memory (fetch, parse, pin), gpu = host memory -> a device slot",
                                      ["level"], buckets=_LOAD_BUCKETS, registry=r)
        self._labels: dict[str, str | None] = {}
        # Speculative decoding, vLLM's counters (exported with the _total suffix, as vLLM's are).
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Verify steps: sequences that ran drafts, per "
                                   "step", ["model_name"], registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified",
                                         ["model_name"], registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                     ["model_name"], registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                                             "accepted at each draft position (0 is the first)",
                                             ["model_name", "position"], registry=r)
        self._spec_seen: dict[tuple, int] = {}  # (counter, *labels) -> the engine's total last seen

    def observe(self, s: EngineStats, tiers: AdapterTiers | None, info: EngineInfo, model: str,
                label_of: Callable[[str], str | None]) -> None:
        """`label_of(version)`: the adapter's label, None for a version gone from the registry; `tiers`
        None: the engine did not answer, and the residency series stay as they were."""
        max_loras = info.max_loras
        pool = info.kv_pool
        self.cache_config.clear()
        self.cache_config.labels(str(pool.block_size), str(pool.blocks), pool.dtype,
                                 str(s.prefix_cache.enabled)).set(1)
        self.waiting.labels(model).set(s.scheduler.waiting)
        self.running.labels(model).set(s.scheduler.running)
        self.kv_usage.labels(model).set(s.kv_blocks.used / s.kv_blocks.total if s.kv_blocks.total else 0.0)
        self._observe_speculative(s.speculative, model)
        if len(self._labels) > _LABEL_CACHE:
            self._labels.clear()
        running = ",".join(self._names(s.scheduler.running_adapters, label_of))
        waiting = ",".join(self._names(s.scheduler.waiting_adapters, label_of))
        self.lora_info.clear()  # one series: the current sets, not every set ever seen
        self.lora_info.labels(running, waiting, str(max_loras)).set(time.time())
        self.gpu_max.labels(model).set(max_loras)
        if tiers is None:
            return
        self.loaded.clear()  # the current residents: an evicted adapter's series goes
        for level, versions in ((GPU, tiers.device), (CPU, tiers.host)):
            for name in self._names(versions, label_of):
                self.loaded.labels(name, level).set(1)
        self.gpu_loaded.labels(model).set(len(tiers.device))

    def observe_load_times(self, times: LoadTimes) -> None:
        for level, durations in ((CPU, times.host), (GPU, times.device)):
            for seconds in durations:
                self.load_seconds.labels(level).observe(seconds)

    def _names(self, versions, label_of: Callable[[str], str | None]) -> list[str]:
        """The labels of `versions` still registered, sorted."""
        names = []
        for v in versions:
            if v not in self._labels:
                self._labels[v] = label_of(v)
            if self._labels[v] is not None:
                names.append(self._labels[v])
        return sorted(names)

    def _observe_speculative(self, spec: SpecDecodeStats, model: str) -> None:
        """The engine keeps totals since start; a counter only goes up, so it takes what is new."""
        if spec.method is None:
            return
        totals = [(self.spec_drafts, (model,), spec.num_drafts),
                  (self.spec_draft_tokens, (model,), spec.num_draft_tokens),
                  (self.spec_accepted, (model,), spec.num_accepted_tokens)]
        totals += [(self.spec_accepted_per_pos, (model, str(j)), n) for j, n in enumerate(spec.accepted_per_position)]
        for counter, labels, total in totals:
            key = (counter, *labels)
            seen = self._spec_seen.get(key, 0)
            # Below what was seen: the engine restarted, and its totals began again.
            counter.labels(*labels).inc(total - seen if total >= seen else total)
            self._spec_seen[key] = total


def adapter_label(record) -> str | None:
    if record is None:
        return None
    return record.name if record.tenant == OPERATOR_OWNER else f"{record.tenant}/{record.name}"
