#!/usr/bin/env python3
"""Async scheduling on and off (`--async-scheduling`, server.engine.async_step), at the engine level, in
paired rounds on one workload: output tok/s, inter-token latency, and the host's time per step (the
engine thread's work outside the forward and sampling) that overlaps the forward when it is on.

A decode-heavy closed batch: `--seqs` requests added at once over `--adapters` adapters and the base
model (every (adapters+1)-th request), greedy, run to completion. Both engines are built first; each
round runs both, alternating which goes first, and checks that they produced the same tokens.
Prints a table and writes JSON.

    .venv/bin/python -m benchmarks.engine.bench_async_scheduling --model-shape smol135 --cpu-threads 1 \\
        --json docs/benchmarks/async-scheduling-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.model_shape import MODEL_SHAPES, build_model_shape
from benchmarks.profile.step_phases import Timer
from server.bench.synth_adapters import ensure_adapters
from server.demo import ensure_demo
from server.engine import EngineConfig, LLMEngine, SamplingParams


def build_engine(model_dir: Path, adapters: dict[str, Path], async_scheduling: bool, args) -> LLMEngine:
    from adapters.format import load_adapter_dir

    engine = LLMEngine(EngineConfig.of(
        model=str(model_dir), device=args.device, dtype=args.dtype, max_loras=max(1, len(adapters)),
        max_lora_rank=args.rank, max_num_seqs=args.seqs, max_num_batched_tokens=4096, max_model_len=512,
        kv_cache_blocks=args.seqs * (512 // 16) + 8, cpu_threads=args.cpu_threads,
        async_scheduling=async_scheduling))
    for name, path in adapters.items():
        engine.add_adapter(name, load_adapter_dir(path, engine.adapter_shape, args.rank))
    return engine


def workload(args, names: list[str], vocab: int, tag: str) -> list[tuple[str, list[int], str | None]]:
    rng = random.Random(args.seed)
    low, high = (int(x) for x in args.prompt_len.split(":"))
    out = []
    for i in range(args.seqs):
        k = i % (len(names) + 1)
        out.append((f"{tag}-{i}", [rng.randrange(3, min(vocab, 500)) for _ in range(rng.randint(low, high))],
                    names[k] if k < len(names) else None))
    return out


class ExecuteTimer(Timer):
    """Times the runner's forward + sampling, and separately the share run on the calling thread (all of
    it when synchronous; the steps that do not overlap when async)."""

    def __init__(self, fn) -> None:
        super().__init__(fn)
        self.thread = threading.get_ident()
        self.on_thread = 0.0

    def __call__(self, *args, **kwargs):
        before = self.total
        try:
            return super().__call__(*args, **kwargs)
        finally:
            if threading.get_ident() == self.thread:
                self.on_thread += self.total - before


def run_once(engine: LLMEngine, requests, max_tokens: int) -> dict:
    """Every request from admission to its last token; times per step and per token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    execute = ExecuteTimer(engine.runner.execute)  # forward + sampling: the worker's share when async
    engine.runner.execute = execute
    overlap = engine.overlap
    collect = Timer(overlap.collect) if overlap is not None else None
    if overlap is not None:
        overlap.collect = collect  # the engine thread's wait for the worker is inside it
        before = overlap.stats()
    times: dict[str, list[float]] = {rid: [] for rid, _, _ in requests}
    tokens: dict[str, list[int]] = {}
    try:
        t0 = time.perf_counter()
        for rid, prompt, name in requests:
            engine.add_request(rid, prompt, params, name)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                new = len(out.token_ids) - len(times[out.request_id])
                times[out.request_id] += [now] * max(0, new)
                if out.finished:
                    tokens[out.request_id] = out.token_ids
        wall = time.perf_counter() - t0
    finally:
        del engine.runner.execute
        if overlap is not None:
            del overlap.collect
    steps = execute.calls
    gaps = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    output_tokens = sum(len(t) for t in tokens.values())
    waited = execute.on_thread + (collect.total if collect is not None else 0.0)
    row = {"wall_s": wall, "output_tokens": output_tokens, "output_tok_s": output_tokens / wall,
           "steps": steps, "step_ms": 1000 * wall / steps,
           "forward_sample_ms_per_step": 1000 * execute.total / steps,
           # The engine thread's own time (schedule, prepare, post-process, the loop): not waiting on the
           # forward; with async scheduling on, the forward of the step in flight runs meanwhile.
           "host_ms_per_step": 1000 * (wall - waited) / steps,
           "itl_ms_p50": 1000 * statistics.median(gaps), "itl_ms_p90": 1000 * _quantile(gaps, 0.9),
           "ttft_ms_p50": 1000 * statistics.median(ts[0] - t0 for ts in times.values() if ts)}
    if overlap is not None:
        after = overlap.stats()
        row.update(launched=after.launched - before.launched, ahead=after.ahead - before.ahead,
                   discarded=after.discarded - before.discarded,
                   host_overlapped_ms_per_step=1000 * (after.host_overlapped_seconds
                                                       - before.host_overlapped_seconds) / steps)
    return {"row": row, "tokens": [tokens[rid] for rid, _, _ in requests]}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-shape", choices=(*MODEL_SHAPES, "demo"), default="smol135",
                    help="random-weight model: smol135 (SmolLM-135M's shape) or the 4-layer demo (default smol135)")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="fewer decoder layers of the same widths (default: the shape's own)")
    ap.add_argument("--work-dir", default=None, help="where models and adapters are built (default: a temp dir)")
    ap.add_argument("--adapters", type=int, default=8, help="distinct adapters, rank --rank (default 8)")
    ap.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    ap.add_argument("--seqs", type=int, default=16, help="requests, all running at once (default 16)")
    ap.add_argument("--prompt-len", default="16:32", help="prompt tokens, uniform low:high (default 16:32)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds, medians reported (default 3)")
    ap.add_argument("--cpu-threads", default="1", help="torch threads, as --cpu-threads (default 1)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto (default float32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench-out/async-scheduling.json")
    args = ap.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="loraplex-async-"))
    if args.model_shape == "demo":
        model_dir = ensure_demo(work / "demo").model_dir
    else:
        model_dir = build_model_shape(args.model_shape, work / f"{args.model_shape}-{args.num_layers or 'all'}",
                                      num_layers=args.num_layers)
    adapters = {f"a{i}": path for i, path in
                ensure_adapters(model_dir, work / "adapters", list(range(args.adapters)), r=args.rank).items()}
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    engines = {False: build_engine(model_dir, adapters, False, args),
               True: build_engine(model_dir, adapters, True, args)}
    warm = workload(args, list(adapters), vocab, "warm")[: len(adapters) + 1]
    for engine in engines.values():  # first touches of every adapter slot and kernel, outside the rounds
        run_once(engine, warm, 4)
    rounds = []
    for r in range(args.rounds):
        requests = workload(args, list(adapters), vocab, f"r{r}")
        load_before = os.getloadavg()[0]
        result = {}
        for mode in ((False, True) if r % 2 == 0 else (True, False)):
            result[mode] = run_once(engines[mode], requests, args.max_tokens)
        same = result[False]["tokens"] == result[True]["tokens"]
        rounds.append({"off": result[False]["row"], "on": result[True]["row"], "same_tokens": same,
                       "speedup": result[True]["row"]["output_tok_s"] / result[False]["row"]["output_tok_s"],
                       "loadavg_1m": [load_before, os.getloadavg()[0]]})
        print(f"round {r}: off {result[False]['row']['output_tok_s']:.1f} tok/s, on "
              f"{result[True]['row']['output_tok_s']:.1f} tok/s, same tokens {same}, load {load_before:.2f}",
              file=sys.stderr, flush=True)
    for engine in engines.values():
        engine.shutdown()

    def med(mode: str, key: str) -> float:
        return statistics.median(r[mode][key] for r in rounds)

    keys = ("output_tok_s", "step_ms", "forward_sample_ms_per_step", "host_ms_per_step", "itl_ms_p50",
            "itl_ms_p90", "ttft_ms_p50")
    summary = {mode: {k: med(mode, k) for k in keys} for mode in ("off", "on")}
    summary["on"]["host_overlapped_ms_per_step"] = med("on", "host_overlapped_ms_per_step")
    summary["speedup_median"] = statistics.median(r["speedup"] for r in rounds)
    summary["speedup_spread"] = [min(r["speedup"] for r in rounds), max(r["speedup"] for r in rounds)]
    print(f"{'mode':>4} {'tok/s':>8} {'step ms':>8} {'fwd+smp':>8} {'host ms':>8} {'ITL p50':>8} {'ITL p90':>8}")
    for mode in ("off", "on"):
        s = summary[mode]
        print(f"{mode:>4} {s['output_tok_s']:>8.1f} {s['step_ms']:>8.2f} {s['forward_sample_ms_per_step']:>8.2f} "
              f"{s['host_ms_per_step']:>8.2f} {s['itl_ms_p50']:>8.2f} {s['itl_ms_p90']:>8.2f}")
    print(f"on/off output tok/s x{summary['speedup_median']:.3f} (median of {len(rounds)} paired rounds, "
          f"spread {summary['speedup_spread'][0]:.3f}-{summary['speedup_spread'][1]:.3f}); host time overlapped "
          f"per step {summary['on']['host_overlapped_ms_per_step']:.2f} ms; same tokens in every round: "
          f"{all(r['same_tokens'] for r in rounds)}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": args.device, "dtype": args.dtype, "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "model_shape": args.model_shape, "num_layers": args.num_layers, "adapters": args.adapters, "rank": args.rank,
        "seqs": args.seqs,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "cpu_threads": args.cpu_threads,
        "summary": summary, "rounds": rounds}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
