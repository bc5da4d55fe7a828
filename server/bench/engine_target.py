"""`--target engine`: the workload through an in-process LLMEngine (add_request/step),
on the same arrival schedule. No HTTP, no Redis: it isolates the engine from the
serving stack; the headline numbers come from the HTTP target."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Callable

from adapters.host_tier import Fetch
from server.bench.metrics import ClosedLoopRun, RequestRecord
from server.bench.step_kinds import StepSample
from server.bench.workload import BenchRequest


def _params(max_tokens: int):
    from server.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _record(rec: RequestRecord, out, t: float) -> bool:
    """Fold one step's output for a request (out: the engine's RequestOutput) into its record at
    time t; whether the request finished."""
    if out.error:
        rec.error = out.error
    new = len(out.token_ids) - rec.output_tokens
    if new > 0:
        rec.first_token_s = t if rec.first_token_s is None else rec.first_token_s
        rec.token_times_s.append(t)
        rec.token_counts.append(new)
        rec.output_tokens = len(out.token_ids)
    if out.finished:
        rec.end_s = t
    return out.finished


class EngineTarget:
    def __init__(self, model_dir: str | Path, adapter_dirs: dict[str, Path], prefix_caching: bool | None = None,
                 adapter_source: Fetch | None = None, **engine_kwargs) -> None:
        """engine_kwargs: EngineConfig fields (device, dtype, max_loras, max_lora_rank, ...);
        prefix_caching: turn the engine's prefix cache on or off (None: the engine's default);
        adapter_source: loads the adapters not in adapter_dirs on demand (LLMEngine's)."""
        from adapters.draft_lora import load_adapter_with_draft
        from server.engine import EngineConfig, LLMEngine

        self.engine = LLMEngine(EngineConfig.of(model=str(model_dir), **engine_kwargs), adapter_source)
        if prefix_caching is not None:
            self.engine.set_prefix_cache_policy(prefix_caching)
        self.outputs: dict[int, list[int]] = {}  # request index -> its output token ids, once finished
        for name, path in adapter_dirs.items():
            adapter = load_adapter_with_draft(path, self.engine.adapter_shape, self.engine.draft_adapter_shape,
                                              self.engine.config.lora.max_lora_rank)
            self.engine.add_adapter(name, adapter)  # the name doubles as the version id: added once

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def warmup(self, requests: list[BenchRequest]) -> None:
        seen = {}
        for r in requests:
            seen.setdefault(r.adapter_name, r)
        for name, r in seen.items():
            self.engine.add_request(f"warm-{r.index}", list(r.prompt_ids[:4]), _params(2), name, r.tenant)
        self._drain()

    def run(self, requests: list[BenchRequest]) -> list[RequestRecord]:
        records = {f"r{r.index}": RequestRecord(r.index, r.tenant, r.adapter_name, r.arrival_s,
                                                len(r.prompt_ids), r.max_tokens) for r in requests}
        pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        t0 = time.perf_counter()
        while pending or self.engine.has_unfinished_requests():
            now = time.perf_counter() - t0
            while pending and pending[0].arrival_s <= now:
                r = pending.popleft()
                # The tenant keys the prefix cache (and fair share), as the HTTP side's does.
                self.engine.add_request(f"r{r.index}", list(r.prompt_ids), _params(r.max_tokens), r.adapter_name,
                                        r.tenant)
            if not self.engine.has_unfinished_requests():
                time.sleep(max(0.0, pending[0].arrival_s - now))
                continue
            outputs = self.engine.step()
            t = time.perf_counter() - t0
            for out in outputs:
                if _record(records[out.request_id], out, t):
                    self.outputs[records[out.request_id].index] = list(out.token_ids)
        return [records[f"r{r.index}"] for r in requests]

    def run_closed_loop(self, trace: list[BenchRequest], concurrency: int, stop_s: float,
                        on_step: Callable[[float], None] | None = None) -> ClosedLoopRun:
        """Keep `concurrency` requests of the trace (in order) in flight, sending the next as one
        finishes, until stop_s seconds; then abort what runs. A request's arrival is when it was sent.
        on_step(t), if given, runs after each step with its time (a bench sampling the engine's state).
        Each step that ran a batch is sampled with its kind (graphed or eager) and wall time."""
        records: list[RequestRecord] = []
        steps: list[StepSample] = []
        counts = self.engine.step_counts()
        running: dict[str, RequestRecord] = {}
        nxt, held_until, exhausted = 0, stop_s, False
        t0 = time.perf_counter()
        while True:
            now = time.perf_counter() - t0
            if now >= stop_s:
                break
            while len(running) < concurrency and nxt < len(trace):
                r = replace(trace[nxt], arrival_s=now)
                nxt += 1
                rec = RequestRecord(r.index, r.tenant, r.adapter_name, now, len(r.prompt_ids), r.max_tokens)
                rid = f"c{r.index}"
                self.engine.add_request(rid, list(r.prompt_ids), _params(r.max_tokens), r.adapter_name, r.tenant)
                running[rid] = rec
                records.append(rec)
            if len(running) < concurrency and not exhausted:
                exhausted, held_until = True, now  # a slot no request can refill: the steady state ends
            if not running:
                break
            start = time.perf_counter() - t0
            outputs = self.engine.step()
            t = time.perf_counter() - t0
            after = self.engine.step_counts()
            if after.steps > counts.steps:
                steps.append(StepSample(t, t - start, after.graphed > counts.graphed))
            counts = after
            if on_step is not None:
                on_step(t)
            for out in outputs:
                if out.request_id in running and _record(running[out.request_id], out, t):
                    del running[out.request_id]
        for rid in running:
            self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return ClosedLoopRun(records, min(held_until, stop_s), exhausted, steps)
