"""DoRA scales computed when an adapter version is accepted, so that every load of it reads them.

A DoRA adapter's first load would otherwise compute its per-output scales m / ||W + s B A|| (a W A^T
over every targeted projection: ~2x a LoRA load's time on the smol135 shape) before storing them for
later loads (server.engine.lora.dora_scale_cache). The server calls `submit` as it accepts a version (an
upload, a source fetch, a preload: server.api.adapter_intake) and waits for it before answering, so a
request right after the upload finds the scales in the store and its load is a reload.

Work runs on one thread of its own, a version at a time (the engine's loader threads and step loop go
on meanwhile), with at most MAX_PENDING versions waiting; past that a version is not precomputed and
its first load computes the scales as before (counted: `precompute_skipped`). A failure here never
fails the intake: the load computes what is missing.

Only CPU engines with a store precompute: there the host tier's loader hook (LoraSlots.prepare) reads
the store. A CUDA engine computes a DoRA adapter's scales as it enters a device slot, against the
weights on the device, and keeps none in the store; nothing here runs there. Such an engine, or one
without a store, answers every submit with "off" and computes no base identity.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from adapters.format import LoraAdapter
from adapters.host_tier import HostTier
from server.engine.lora.dora_scale_cache import DoraScaleCache

log = logging.getLogger(__name__)

# Versions queued behind the one being computed: each holds its adapter's tensors (float32) meanwhile.
MAX_PENDING = 8


class DoraPrecompute:
    """`host`: the engine's host tier (packs an adapter as a load does, then its loader hook computes and
    stores the scales); `cache`: the slots' DoRA scale cache (None: the engine serves no DoRA)."""

    def __init__(self, host: HostTier, cache: DoraScaleCache | None) -> None:
        self.host = host
        self.cache = cache
        self.enabled = cache is not None and cache.store is not None and host.prepare is not None
        self._lock = threading.Lock()
        self._pending = 0  # submitted and not finished
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dora-precompute") if self.enabled else None
        if self.enabled:
            cache.prime()  # the identity stored scales are keyed by: at start-up, not at the first DoRA load

    def submit(self, version: str, adapter: LoraAdapter) -> Future[str]:
        """Compute and store `version`'s scales unless the store has them. The future's outcome: "computed",
        "present", "lora" (no DoRA module), "off" (this engine keeps no scales), "busy" (MAX_PENDING
        waiting: the first load computes them), "failed" (logged; the first load computes them)."""
        outcome = None
        if not self.enabled:
            outcome = "off"
        elif not adapter.use_dora:
            outcome = "lora"
        else:
            with self._lock:
                if self._pending > MAX_PENDING:
                    outcome = "busy"
                else:
                    self._pending += 1
        if outcome is None:
            job = self._pool.submit(self._run, version, adapter)
            job.add_done_callback(self._finished)  # run, failed or cancelled before it ran
            return job
        if outcome == "busy":
            self.cache.count("precompute_skipped")
        done: Future[str] = Future()
        done.set_result(outcome)
        return done

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, version: str, adapter: LoraAdapter) -> str:
        try:
            numel = sum(w.magnitude.numel() for w in adapter.weights.values() if w.magnitude is not None)
            if self.cache.read(version, numel, count_read=False) is not None:
                return "present"
            # The values a load packs (serving dtype), so the scales equal the ones the load would compute.
            self.host.packed(adapter, version)
            self.cache.count("precomputed")
            return "computed"
        except Exception:  # noqa: BLE001 - a derived value: its load computes it instead
            log.exception("precomputing the DoRA scales of %s failed: its first load computes them", version)
            return "failed"

    def _finished(self, _job: Future) -> None:
        with self._lock:
            self._pending -= 1
