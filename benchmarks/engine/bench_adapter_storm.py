#!/usr/bin/env python3
"""A storm of new adapters at the engine level (bench_cold_sources' warm storm without HTTP): a victim
tenant decodes on the base model while a storm tenant sends one-token requests for --adapters distinct
adapters (--in-flight of them waiting at a time, as bench_cold_sources' 32 clients keep them), more than
the --max-loras slots hold, so each storm request loads its adapter into a slot and prefills its prompt
in a step the victim decodes in. The server's CPU defaults: the demo model, rank-16 adapters, 8 slots,
the latency-aware prefill cap (256 and 1.25x), one torch thread.

Per step: its wall time, the copies into adapter slots made in it (Scheduler.slot_loads, each timed), the
storm's new adapters and prompt tokens in it, and `schedule`'s own time (which holds the copies). The
victim's gaps (the steps that gave it a token) during the storm against its decode-only steps, in wall
time and in the step thread's CPU time (on a shared machine, a step's own work), and the slowest 1% of its
gaps split into those parts: which part of a step the p99 is. Two engines side by side,
alternating each round: slot loads charged against the prefill cap while others decode (the default:
server.engine.step_latency.load_units) and not (the scheduler before).

    .venv/bin/python -m benchmarks.engine.bench_adapter_storm --rounds 3 --json docs/benchmarks/adapter-storm-cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from adapters.format import load_adapter_dir
from benchmarks.engine.bench_fair_steps import Victim, p99, report
from benchmarks.profile.step_phases import PHASES, timed_phases
from server.bench.synth_adapters import ensure_adapters
from server.engine.config import CPU_PREFILL_CAP, CPU_PREFILL_STEP_RATIO
from server.demo import ensure_demo
from server.engine import EngineConfig, LLMEngine, SamplingParams

STORM_PROMPT = [11, 42, 97, 5, 64, 23, 7, 8, 9, 10, 12]  # 11 tokens, like bench_cold_sources' prompt
# Paired engines, alternating each round: slot loads charged against the prefill cap (the scheduler's
# default), and not (its latency estimate's load_units held at 0: the scheduler before the charge).
SETTINGS = ("loads uncharged", "loads charged")
WARM_PROMPTS = 8


@dataclass(frozen=True)
class StepRecord:
    seconds: float
    cpu_s: float  # the step thread's CPU time: the step's own work, whatever else the machine runs
    phases_s: dict[str, float]  # benchmarks.profile.step_phases' phases of the step (schedule holds the copies)
    slot_load_s: float
    slot_loads: int
    new_adapters: int  # storm sequences that started their prompt in the step
    prompt_tokens: int  # storm prompt tokens computed in the step
    victim_token: bool


def build(model_dir: Path, args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(EngineConfig.of(
        str(model_dir), device="cpu", max_loras=args.max_loras, max_lora_rank=64,
        max_prefill_tokens_while_decoding=CPU_PREFILL_CAP, max_prefill_step_ratio=CPU_PREFILL_STEP_RATIO,
        cpu_threads=args.cpu_threads))


class _Recorder:
    """Reads what each `schedule` put in the batch, installed on one engine's scheduler."""

    def __init__(self, engine: LLMEngine) -> None:
        self.scheduler = engine.scheduler
        self.inner = self.scheduler.schedule
        self.scheduler.schedule = self._schedule
        self.new_adapters = self.prompt_tokens = 0

    def _schedule(self):
        batch = self.inner()
        storm = [(s, n) for s, n in zip(batch.seqs, batch.num_tokens) if s.tenant == "storm"]
        self.new_adapters = sum(1 for s, _ in storm if s.num_computed_tokens == 0)
        self.prompt_tokens = sum(n for _, n in storm)
        return batch


def run_round(engine: LLMEngine, tag: str, adapters: list[str], args: argparse.Namespace) -> dict:
    with timed_phases(engine) as timers:
        recorder = _Recorder(engine)
        try:
            return _storm_round(engine, timers, recorder, tag, adapters, args)
        finally:
            engine.scheduler.schedule = recorder.inner


def _storm_round(engine: LLMEngine, timers: dict, recorder: _Recorder, tag: str, adapters: list[str],
                 args: argparse.Namespace) -> dict:
    scheduler = engine.scheduler
    victim = Victim(engine, tag)
    decode_only = victim.decode_alone(args.warm_steps)
    decode_cpu = victim.decode_alone(args.warm_steps, time.thread_time)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # Base-model prompts beside the decode teach the cap's unit estimate, as the victim's own prompts do in a server.
    for i in range(WARM_PROMPTS):
        engine.add_request(f"{tag}-warm-{i}", STORM_PROMPT, one, tenant="warm")
        while engine.has_unfinished_requests() and not any(o.request_id == f"{tag}-warm-{i}" and o.finished
                                                           for o in engine.step()):
            pass
    sent, done, in_flight = 0, 0, set()
    steps: list[StepRecord] = []
    started = time.perf_counter()
    while done < len(adapters):
        while len(in_flight) < args.in_flight and sent < len(adapters):
            rid = f"{tag}-storm-{sent}"
            engine.add_request(rid, STORM_PROMPT, one, adapters[sent], tenant="storm")
            in_flight.add(rid)
            sent += 1
        loads, loads_s = scheduler.slot_loads, scheduler.slot_loads_s
        before = {phase: t.total for phase, t in timers.items()}
        start, cpu = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
        phases = {phase: t.total - before[phase] for phase, t in timers.items()}
        got = False
        for out in outputs:
            if out.request_id in in_flight:
                if out.finished:
                    in_flight.discard(out.request_id)
                    done += 1
                continue
            got = got or out.request_id == victim.request_id
            if out.request_id == victim.request_id and out.finished:
                victim.next()
        steps.append(StepRecord(seconds, cpu, phases, scheduler.slot_loads_s - loads_s,
                                scheduler.slot_loads - loads, recorder.new_adapters, recorder.prompt_tokens, got))
    wall = time.perf_counter() - started
    engine.abort_request(victim.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    gaps = [s for s in steps if s.victim_token]
    slowest = sorted(gaps, key=lambda s: s.seconds)[-max(1, len(gaps) // 100):]
    mean = lambda f, rows: statistics.fmean(f(s) for s in rows)  # noqa: E731
    plain = [s for s in gaps if s.prompt_tokens == 0]  # steps of the storm in which only the victim ran
    base_p99 = p99(decode_only)
    return {
        "decode_only_p50_ms": statistics.median(decode_only) * 1e3, "decode_only_p99_ms": base_p99 * 1e3,
        "victim_gap_p50_ms": statistics.median(s.seconds for s in gaps) * 1e3,
        "victim_gap_p99_ms": p99([s.seconds for s in gaps]) * 1e3,
        "p99_vs_decode_only_p99": p99([s.seconds for s in gaps]) / base_p99,
        # the same in CPU time of the step thread: on a shared machine, the steps' own work
        "decode_only_cpu_p99_ms": p99(decode_cpu) * 1e3,
        "victim_gap_cpu_p50_ms": statistics.median(s.cpu_s for s in gaps) * 1e3,
        "victim_gap_cpu_p99_ms": p99([s.cpu_s for s in gaps]) * 1e3,
        "cpu_p99_vs_decode_only_cpu_p99": p99([s.cpu_s for s in gaps]) / p99(decode_cpu),
        "storm_steps": len(steps), "storm_wall_s": wall, "victim_tokens_during": len(gaps),
        "steps_without_victim_token": len(steps) - len(gaps),
        "slot_loads": sum(s.slot_loads for s in steps),
        "max_new_adapters_per_step": max(s.new_adapters for s in steps),
        # the slowest 1% of the victim's gaps, and its decode-only steps' median, split: copies into slots, the
        # rest of schedule, prepare (the batch, its LoRA groups), forward, sample, postprocess
        "storm_free_steps": {"steps": len(plain), **(_split(plain) if plain else {})},  # the victim's alone
        "slowest_1pct": {"steps": len(slowest), **_split(slowest),
                         "slot_loads": mean(lambda s: s.slot_loads, slowest),
                         "new_adapters": mean(lambda s: s.new_adapters, slowest),
                         "prompt_tokens": mean(lambda s: s.prompt_tokens, slowest)},
    }


def _split(rows: list[StepRecord]) -> dict[str, float]:
    """Mean milliseconds of `rows` in all and per part."""
    mean = lambda f: statistics.fmean(f(s) for s in rows) * 1e3  # noqa: E731
    out = {"step_ms": mean(lambda s: s.seconds), "cpu_ms": mean(lambda s: s.cpu_s), "slot_load_ms": mean(lambda s: s.slot_load_s),
           "schedule_other_ms": mean(lambda s: s.phases_s["schedule"] - s.slot_load_s)}
    for phase in PHASES[1:]:
        out[f"{phase}_ms"] = mean(lambda s: s.phases_s[phase])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--adapters", type=int, default=100, help="distinct storm adapters (default 100)")
    ap.add_argument("--in-flight", type=int, default=32, help="storm requests waiting at once (default 32)")
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--warm-steps", type=int, default=200)
    ap.add_argument("--cpu-threads", default="1", help="the engine's intra-op threads (default 1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.gettempdir()) / "loraplex-bench-demo"
    demo = ensure_demo(work)
    dirs = ensure_adapters(demo.model_dir, work / "adapters", list(range(args.adapters)), r=args.rank)
    engines = {name: build(demo.model_dir, args) for name in SETTINGS}
    # The scheduler before slot loads were charged: a load costs its tenant's share nothing.
    engines["loads uncharged"].scheduler.latency.load_units = lambda: 0.0
    packed = [load_adapter_dir(d, engines["loads charged"].adapter_shape, 64) for d in dirs.values()]
    rounds: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
            names = [f"r{r}-a{i}@1" for i in range(args.adapters)]  # new versions each round: none resident
            for version, adapter in zip(names, packed):
                engines[name].add_adapter(version, adapter)
            rounds[name].append(run_round(engines[name], f"r{r}", names, args))
            print(f"round {r + 1}, {name}: " + json.dumps(
                {k: round(v, 2) if isinstance(v, float) else v for k, v in rounds[name][-1].items()}), flush=True)
    report(rounds, ("victim_gap_p50_ms", "victim_gap_p99_ms", "p99_vs_decode_only_p99", "victim_gap_cpu_p50_ms",
                    "victim_gap_cpu_p99_ms", "cpu_p99_vs_decode_only_cpu_p99", "storm_steps",
                    "max_new_adapters_per_step"), args)
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
