"""The metrics LoRA-aware routers and autoscalers read, with vLLM's names and meanings (the Gateway
API Inference Extension's model-server protocol, llm-d, KEDA rules written for vLLM), beside ours.

Adapters are named by their owner: `<tenant id>/<name>` for a tenant's (a tenant id is immutable, and
another tenant's adapter of the same name is another adapter), the bare name for the operator's
--lora-modules (global names, as in vLLM). They name tenants' adapters, so they sit behind the
metrics credential with the rest of /metrics."""
from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from adapters.sharing import OPERATOR_OWNER
from server.engine.protocol import EngineStats
from server.engine.spec_decode_stats import SpecDecodeStats

# Versions are immutable, so their labels can be remembered; the bound keeps a long-lived server's
# memory flat (a miss costs one Redis read).
_LABEL_CACHE = 4096


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

    def observe(self, s: EngineStats, model: str, max_loras: int, label_of: Callable[[str], str | None]) -> None:
        """`label_of(version)`: the adapter's label, None for a version gone from the registry."""
        self.waiting.labels(model).set(s.scheduler.waiting)
        self.running.labels(model).set(s.scheduler.running)
        self.kv_usage.labels(model).set(s.kv_blocks.used / s.kv_blocks.total if s.kv_blocks.total else 0.0)
        self._observe_speculative(s.speculative, model)
        if len(self._labels) > _LABEL_CACHE:
            self._labels.clear()
        names = []
        for versions in (s.scheduler.running_adapters, s.scheduler.waiting_adapters):
            labels = []
            for v in versions:
                if v not in self._labels:
                    self._labels[v] = label_of(v)
                if self._labels[v] is not None:
                    labels.append(self._labels[v])
            names.append(",".join(sorted(labels)))
        self.lora_info.clear()  # one series: the current sets, not every set ever seen
        self.lora_info.labels(names[0], names[1], str(max_loras)).set(time.time())


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
