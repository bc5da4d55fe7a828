#!/usr/bin/env python3
"""A fleet of 1,000 adapters under Zipf(1.0) popularity against the same trace over 8 (issue 38, item 5).

1,000 distinct adapters (benchmarks.serving.fleet_adapters: ranks drawn from {8, 16, 32, 64, 128}),
loaded on demand through the engine's adapter source into a host tier of --host-share of the fleet's
bytes, and from there into the device's adapter memory: today's slots of --max-lora-rank rows, and
pages of --page-rows rank rows (--lora-page-rows), both --max-loras slots' worth of bytes (with
--unified-memory the pages' runs share one pool with the KV blocks: mode "unified"). Requests:
Zipf(1.0) over the fleet (adapter k drawn with weight 1/(k+1)), prompts and outputs of --prompt-len
and --output-len tokens, --concurrency streams kept in flight (closed loop: the next request is sent
as one finishes; server.bench.engine_target), measured over a window after a warm-up. The 8-adapter
run is the same trace with each request on the pool adapter of its rank (same LoRA work per request),
so the ratio is the cost of the fleet's size alone: its misses, and more distinct adapters per step. Rounds run the four runs in alternating order,
each round on its own stretch of the trace; each row is the median round, its ratio paired within rounds.

Per row: decode tokens/s in the window, device and host hit rates (slot acquisitions that found the
adapter resident; host-tier lookups that found it parsed), device loads (swaps) per second, TTFT and
ITL percentiles, adapters resident on the device on average and per GiB of its adapter memory, and
TTFT split by whether the request's adapter was on the device when it was sent (what p99 is made of).

The in-process engine (no HTTP, no Redis): registering 1,000 adapters over HTTP costs minutes on this
machine and measures the registry, not the engine's tiers; the source parses each load's bytes as a
Redis fetch would. Machine: its CPU model and load average at start and end are in the JSON.

    .venv/bin/python -m benchmarks.serving.fleet --json docs/benchmarks/fleet-cpu.json
    .venv/bin/python -m benchmarks.serving.fleet --quick --json /tmp/fleet.json   # a tiny trace (tests)
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adapters.format import ModelShape
from benchmarks.profile.cpu_model import cpu_model
from benchmarks.serving.fleet_adapters import RANKS, FleetSource, draw_fleet, same_rank_pool
from server.bench import bandwidth
from server.bench.engine_target import EngineTarget
from server.bench.metrics import percentile, window_summary
from server.bench.workload import BenchRequest, adapter_name, tenant_of_adapter
from server.demo import ensure_demo

def modes(cfg: FleetConfig) -> tuple[str, str]:
    """Today's slots, and pages: in their own budget, or with --unified-memory in one pool with the KV."""
    return "slots", "unified" if cfg.unified_memory else "paged"


@dataclass(frozen=True)
class FleetConfig:
    adapters: int = 1000
    small: int = 8
    concurrency: int = 64
    prompt_len: tuple[int, int] = (16, 128)  # chat-like lengths, scaled down for 2 CPU cores
    output_len: tuple[int, int] = (8, 64)
    requests: int = 6000
    warmup_s: float = 10.0
    window_s: float = 30.0
    rounds: int = 2
    max_loras: int = 64
    max_lora_rank: int = 128
    page_rows: int = 8
    host_share: float = 0.25
    bases: int = 2
    tenants: int = 4
    seed: int = 0
    cpu_threads: int = 1
    unified_memory: bool = False  # the pages' runs draw from one pool with the KV blocks (--unified-memory)


@dataclass
class Sampler:
    """The engine's tier counters after each step, and the device's and host's residents when they change."""
    engine: object
    rank_of: dict[str, int]
    times: list[float] = field(default_factory=list)
    counters: list[tuple[int, ...]] = field(default_factory=list)  # device hits, loads; host hits, misses
    resident: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)  # sequences in the batch: what the misses shrink
    distinct: list[int] = field(default_factory=list)  # adapters in the batch: whose weights a step reads
    rank_rows: list[int] = field(default_factory=list)  # the sum of their ranks
    device_sets: list[tuple[float, frozenset]] = field(default_factory=list)
    host_sets: list[tuple[float, frozenset]] = field(default_factory=list)

    def __call__(self, t: float) -> None:
        slots, host = self.engine.lora_slots, self.engine.host
        self.times.append(t)
        self.counters.append((slots.hits, slots.loads, host.stats.hits, host.stats.misses))
        self.resident.append(len(slots.slot_of))
        running = self.engine.scheduler.running
        self.running.append(len(running))
        versions = {seq.version_id for seq in running if seq.version_id is not None}
        self.distinct.append(len(versions))
        self.rank_rows.append(sum(self.rank_of[v] for v in versions))
        if not self.device_sets or self.device_sets[-1][1] != slots.slot_of.keys():
            self.device_sets.append((t, frozenset(slots.slot_of)))
        if not self.host_sets or self.host_sets[-1][1] != self.host.entries.keys():
            self.host_sets.append((t, frozenset(self.host.entries)))

    @property
    def host(self):
        return self.engine.host

    def delta(self, start_s: float, end_s: float) -> tuple[int, ...]:
        i = max(0, bisect.bisect_left(self.times, start_s) - 1)
        j = max(0, bisect.bisect_left(self.times, end_s) - 1)
        return tuple(b - a for a, b in zip(self.counters[i], self.counters[j]))

    def mean(self, series: list[int], start_s: float, end_s: float) -> float:
        inside = [n for t, n in zip(self.times, series) if start_s <= t < end_s]
        return statistics.mean(inside) if inside else 0.0

    @staticmethod
    def at(sets: list[tuple[float, frozenset]], t: float) -> frozenset:
        k = bisect.bisect_right([s[0] for s in sets], t) - 1
        return sets[k][1] if k >= 0 else frozenset()


def zipf_trace(cfg: FleetConfig, vocab: int) -> list[BenchRequest]:
    """cfg.requests requests: adapter k of the fleet with weight 1 / (k + 1), prompts and lengths seeded."""
    rng, arng = random.Random(cfg.seed), random.Random(f"{cfg.seed}:zipf")
    cum, total = [], 0.0
    for k in range(cfg.adapters):
        total += 1.0 / (k + 1)
        cum.append(total)
    out = []
    for i in range(cfg.requests):
        a = min(bisect.bisect_left(cum, arng.random() * total), cfg.adapters - 1)
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(*cfg.prompt_len)))
        out.append(BenchRequest(i, 0.0, a, tenant_of_adapter(a, cfg.tenants), prompt, rng.randint(*cfg.output_len)))
    return out


def adapter_memory_bytes(engine) -> int:
    """The device's adapter buffers (A, B, scalings, DoRA scales) and its rank and page tables; with
    --unified-memory, whose page buffers span the whole pool, the adapter share's bytes in place of A and B."""
    slots = engine.lora_slots
    groups = [g for layer in slots.layers for g in layer.values()]
    units = slots.units
    if units is None:
        weights = sum(t.numel() * t.element_size() for g in groups for t in (g.a, *g.b))
    else:
        weights = units.pool.adapter_share * units.pool.unit_bytes
    entries = sum(t.numel() * t.element_size() for g in groups for t in (g.scaling, g.dora_scale))
    return weights + entries + sum(t.numel() * t.element_size() for t in (slots.rank_table, slots.page_table)
                                   if t is not None)


def build_engine(cfg: FleetConfig, model_dir: Path, source: FleetSource, mode: str, host_bytes: int) -> EngineTarget:
    blocks = cfg.concurrency * -(-(cfg.prompt_len[1] + cfg.output_len[1]) // 16) + 16
    target = EngineTarget(model_dir, {}, device="cpu", dtype="float32", max_loras=cfg.max_loras,
                          max_lora_rank=cfg.max_lora_rank, kv_cache_blocks=blocks,
                          max_num_seqs=cfg.concurrency, cpu_threads=cfg.cpu_threads,
                          lora_page_rows=None if mode == "slots" else cfg.page_rows,
                          unified_memory=mode == "unified",
                          max_cpu_lora_bytes=host_bytes, adapter_source=source)
    return target


def measure(cfg: FleetConfig, target: EngineTarget, trace: list[BenchRequest], rank_of: dict[str, int],
            label: dict) -> dict:
    sampler = Sampler(target.engine, rank_of)
    load = os.getloadavg()
    run = target.run_closed_loop(trace, cfg.concurrency, cfg.warmup_s + cfg.window_s, on_step=sampler)
    start, end = cfg.warmup_s, run.held_until_s
    window = window_summary(run.records, start, end)
    d_hits, d_loads, h_hits, h_misses = sampler.delta(start, end)
    span = max(end - start, 1e-9)
    split: dict[str, list[float]] = {"device_hit": [], "device_miss": [], "host_miss": []}
    for r in run.records:
        if not start <= r.arrival_s < end or r.first_token_s is None:
            continue
        if r.adapter in Sampler.at(sampler.device_sets, r.arrival_s):
            split["device_hit"].append(r.ttft_s)
        elif r.adapter in Sampler.at(sampler.host_sets, r.arrival_s):
            split["device_miss"].append(r.ttft_s)
        else:
            split["host_miss"].append(r.ttft_s)
    mem = adapter_memory_bytes(target.engine)
    resident = sampler.mean(sampler.resident, start, end)
    loads = list(target.engine.host.load_seconds)
    return {**label, "load_avg_start": load, "window": window, "trace_exhausted": run.trace_exhausted,
            "device_hit_rate": d_hits / (d_hits + d_loads) if d_hits + d_loads else None,
            "host_hit_rate": h_hits / (h_hits + h_misses) if h_hits + h_misses else None,
            "device_loads": d_loads, "host_loads": h_misses, "swaps_per_s": d_loads / span,
            "host_loads_per_s": h_misses / span, "adapter_memory_bytes": mem,
            "resident_mean": resident, "resident_per_gib": resident / (mem / 2**30),
            "running_mean": sampler.mean(sampler.running, start, end),
            "distinct_in_batch_mean": sampler.mean(sampler.distinct, start, end),
            "rank_rows_in_batch_mean": sampler.mean(sampler.rank_rows, start, end),
            "distinct_adapters_sent": len({r.adapter for r in run.records if start <= r.arrival_s < end}),
            "host_load_s": {"p50": percentile(loads, 50), "p99": percentile(loads, 99), "count": len(loads)},
            "ttft_by_residency": {k: {"requests": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99)}
                                  for k, v in split.items()}}


def bytes_bound(model_cfg: dict, max_rank: int, fleet_row: dict, small_runs: list[dict]) -> dict:
    """The fleet/small throughput ratio if a step took time in proportion to the weights it reads
    (server.bench.bandwidth): the base's, plus each distinct adapter in the batch at the batch's
    largest rank (the CPU path's chunks are computed at it: padded) or at its own (rank_rows)."""
    base = bandwidth.base_weight_bytes(model_cfg, 4)
    row_bytes = bandwidth.adapter_bytes(model_cfg, 1, 4)  # one rank row of every projection, float32
    small = statistics.median(r["distinct_in_batch_mean"] for r in small_runs)
    small_rows = statistics.median(r["rank_rows_in_batch_mean"] for r in small_runs)
    padded = (base + small * max_rank * row_bytes) / (base + fleet_row["distinct_in_batch_mean"] * max_rank * row_bytes)
    own = (base + small_rows * row_bytes) / (base + fleet_row["rank_rows_in_batch_mean"] * row_bytes)
    return {"base_weight_bytes": base, "rank_row_bytes": row_bytes, "padded": padded, "own_rank": own}


def run(cfg: FleetConfig, work_dir: Path, log=print) -> dict:
    model_dir = ensure_demo(work_dir / "demo").model_dir
    model_cfg = json.loads((model_dir / "config.json").read_text())
    shape = ModelShape.from_hf_config(model_cfg)
    fleet = draw_fleet(cfg.adapters, cfg.seed, RANKS, cfg.bases)
    pool, to_pool = same_rank_pool(fleet, cfg.small, RANKS)
    specs = {adapter_name(i): a for i, a in {**fleet, **pool}.items()}
    rank_of = {name: a.rank for name, a in specs.items()}
    source = FleetSource(model_dir, shape, cfg.max_lora_rank, specs, cfg.bases, cfg.seed)
    fleet_bytes = sum(source.bytes_of(adapter_name(i)) for i in fleet)
    host_bytes = max(int(cfg.host_share * fleet_bytes), max(source.bytes_of(n) for n in specs))
    trace = zipf_trace(cfg, model_cfg["vocab_size"])
    traces = {"fleet": trace,
              "small": [BenchRequest(r.index, 0.0, to_pool[r.adapter], tenant_of_adapter(to_pool[r.adapter],
                                     cfg.tenants), r.prompt_ids, r.max_tokens) for r in trace]}
    sizes = {"fleet": cfg.adapters, "small": cfg.small}
    log(f"fleet: {cfg.adapters} adapters (ranks {RANKS}), host tier {host_bytes / 2**20:.1f} MiB of "
        f"{fleet_bytes / 2**20:.1f} MiB; {cfg.small}-adapter pool; {cfg.concurrency} streams; "
        f"{cfg.warmup_s:g} s warm-up + {cfg.window_s:g} s window x {cfg.rounds} rounds")
    engines = {(mode, which): build_engine(cfg, model_dir, source, mode, host_bytes)
               for mode in modes(cfg) for which in ("fleet", "small")}
    runs: dict[tuple[str, str], list[dict]] = {k: [] for k in engines}
    keys = list(engines)
    for r in range(cfg.rounds):
        for key in (keys if r % 2 == 0 else keys[::-1]):
            mode, which = key
            t = time.perf_counter()
            # Each round sends a later stretch of the trace (the same in its four runs): a replay of the
            # last round's requests would find their adapters still resident.
            offset = r * len(trace) // cfg.rounds
            row = measure(cfg, engines[key], traces[which][offset:], rank_of,
                          {"mode": mode, "adapters": sizes[which], "round": r})
            runs[key].append(row)
            log(f"  round {r + 1} {mode:<5} {sizes[which]:>5} adapters: "
                f"{row['window']['throughput_tok_s'] or 0:.1f} tok/s, device hits {row['device_hit_rate'] or 0:.2f}, "
                f"{row['swaps_per_s']:.1f} swaps/s ({time.perf_counter() - t:.0f} s)")
    for target in engines.values():
        target.engine.shutdown()
    rows = []
    for mode in modes(cfg):
        for which in ("fleet", "small"):
            rs = runs[(mode, which)]
            speeds = [x["window"]["throughput_tok_s"] or 0.0 for x in rs]
            med = sorted(rs, key=lambda x: x["window"]["throughput_tok_s"] or 0.0)[(len(rs) - 1) // 2]
            row = {**med, "rounds_tok_s": speeds}
            if which == "fleet":
                ratios = [a["window"]["throughput_tok_s"] / b["window"]["throughput_tok_s"]
                          for a, b in zip(rs, runs[(mode, "small")])
                          if a["window"]["throughput_tok_s"] and b["window"]["throughput_tok_s"]]
                row["ratio_vs_small"] = statistics.median(ratios) if ratios else None
                row["ratio_rounds"] = ratios
                row["bytes_bound"] = bytes_bound(model_cfg, cfg.max_lora_rank, row, runs[(mode, "small")])
            rows.append(row)
    return {"config": {**cfg.__dict__, "ranks": list(RANKS), "host_bytes": host_bytes, "fleet_bytes": fleet_bytes,
                       "model": "demo model (Llama, 4 layers, hidden 128, random weights), float32",
                       "target": "in-process engine (server.bench.engine_target), closed loop"},
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__},
            "rows": rows}


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def format_table(doc: dict) -> str:
    head = (f"{'mode':<6}{'adapters':>9}{'tok/s':>9}{'x 8':>6}{'dev hit':>8}{'host hit':>9}{'swaps/s':>8}"
            f"{'TTFT p50':>9}{'p99':>7}{'ITL p50':>8}{'p99':>6}{'batch':>6}{'resident':>9}{'/GiB':>8}   (ms)")
    lines = [head, "-" * len(head)]
    for r in doc["rows"]:
        w = r["window"]
        lines.append(f"{r['mode']:<6}{r['adapters']:>9}{w['throughput_tok_s'] or 0:>9.1f}"
                     f"{'-' if r.get('ratio_vs_small') is None else format(r['ratio_vs_small'], '.2f'):>6}"
                     f"{r['device_hit_rate'] or 0:>8.2f}{r['host_hit_rate'] or 0:>9.2f}{r['swaps_per_s']:>8.1f}"
                     f"{_ms(w['ttft_s']['p50']):>9}{_ms(w['ttft_s']['p99']):>7}{_ms(w['itl_s']['p50']):>8}"
                     f"{_ms(w['itl_s']['p99']):>6}{r['running_mean']:>6.1f}{r['resident_mean']:>9.1f}{r['resident_per_gib']:>8.0f}")
    for r in doc["rows"]:
        if r["adapters"] == doc["config"]["adapters"]:
            parts = ", ".join(f"{k} {v['requests']} p50 {_ms(v['p50'])} p99 {_ms(v['p99'])}"
                              for k, v in r["ttft_by_residency"].items())
            b = r["bytes_bound"]
            lines.append(f"{r['mode']} fleet: {r['distinct_in_batch_mean']:.1f} adapters in a step's batch on average; "
                         f"bytes-only bound x{b['padded']:.2f} (adapters read at the batch's largest rank), "
                         f"x{b['own_rank']:.2f} (at their own)")
            lines.append(f"{r['mode']} fleet TTFT by the adapter's place when sent: {parts}; "
                         f"host loads p50 {_ms(r['host_load_s']['p50'])} p99 {_ms(r['host_load_s']['p99'])} ms")
    m = doc["machine"]
    lines.append(f"{m['cpu']} x{m['cores']}; load average {m['load_average_start'][0]:.1f} at start, "
                 f"{m['load_average_end'][0]:.1f} at end")
    return "\n".join(lines)


QUICK = dict(adapters=40, small=8, concurrency=8, prompt_len=(8, 32), output_len=(4, 16), requests=400,
             warmup_s=1.0, window_s=2.0, rounds=1, max_loras=4)


def parse_args(argv: list[str] | None) -> tuple[FleetConfig, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = FleetConfig()
    ap.add_argument("--adapters", type=int, default=d.adapters, help=f"fleet size (default {d.adapters})")
    ap.add_argument("--small", type=int, default=d.small, help=f"the comparison's adapters (default {d.small})")
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--requests", type=int, default=d.requests, help="trace length (each run sends from its start)")
    ap.add_argument("--warmup", type=float, default=d.warmup_s)
    ap.add_argument("--window", type=float, default=d.window_s)
    ap.add_argument("--rounds", type=int, default=d.rounds)
    ap.add_argument("--max-loras", type=int, default=d.max_loras, help="device adapter memory, in max-rank slots")
    ap.add_argument("--page-rows", type=int, default=d.page_rows)
    ap.add_argument("--host-share", type=float, default=d.host_share, help="host tier: this share of the fleet's bytes")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--quick", action="store_true", help="a tiny trace over 40 adapters (the test's)")
    ap.add_argument("--unified-memory", action="store_true",
                    help="the pages' runs with --unified-memory: one pool with the KV blocks (mode 'unified')")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work-dir", type=Path, default=Path("bench-out"), help="where the demo model is made once")
    a = ap.parse_args(argv)
    if a.quick:
        return FleetConfig(**QUICK, unified_memory=a.unified_memory), a
    cfg = FleetConfig(adapters=a.adapters, small=a.small, concurrency=a.concurrency, requests=a.requests,
                      warmup_s=a.warmup, window_s=a.window, rounds=a.rounds, max_loras=a.max_loras,
                      page_rows=a.page_rows, host_share=a.host_share, seed=a.seed, unified_memory=a.unified_memory)
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    json_path = args.json
    load_start = os.getloadavg()
    doc = run(cfg, args.work_dir, log=lambda m: print(m, file=sys.stderr, flush=True))
    doc["machine"].update(load_average_start=load_start, load_average_end=os.getloadavg())
    print(format_table(doc))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
