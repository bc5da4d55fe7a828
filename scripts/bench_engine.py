#!/usr/bin/env python3
"""Host-side time per engine step outside the model forward, at 16/64/256 running sequences.

On a GPU this overhead (scheduling, block tables, adapter metadata, sampling
bookkeeping, detokenisation), not the math, decides small-batch speed.
Prints a table and writes JSON.

    .venv/bin/python scripts/bench_engine.py --json bench-out/engine.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import server.engine.model_runner as model_runner  # noqa: E402
from server.demo import ensure_demo  # noqa: E402
from server.engine import LLM, SamplingParams  # noqa: E402


class Timer:
    """Wraps a callable and accumulates its wall time."""

    def __init__(self, fn):
        self.fn = fn
        self.total = 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t


def measure(llm: LLM, adapters: list[str], num_seqs: int, steps: int, seed: int) -> dict:
    engine = llm.engine
    rng = random.Random(seed)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(8, 32))]
        name = adapters[i % (len(adapters) + 1)] if i % (len(adapters) + 1) < len(adapters) else None
        engine.add_request(f"b{num_seqs}-{i}", prompt, SamplingParams(max_tokens=steps + 40, temperature=0.0,
                                                                      ignore_eos=True),
                           llm._versions[name] if name else None)
    while engine.stats().num_running < num_seqs or any(
        s.num_pending_tokens > 1 for s in engine.scheduler.running
    ):
        engine.step()  # until every sequence is decoding
    timers = {
        "schedule": Timer(engine.scheduler.schedule),
        "prepare": Timer(engine.runner.prepare),
        "forward": Timer(engine.runner.model.forward),
        "sample": Timer(model_runner.sample),
        "postprocess": Timer(engine.postprocess),
    }
    engine.scheduler.schedule = timers["schedule"]
    engine.runner.prepare = timers["prepare"]
    engine.runner.model.forward = timers["forward"]
    model_runner.sample = timers["sample"]
    engine.postprocess = timers["postprocess"]
    per_step, overhead = [], []
    try:
        for _ in range(steps):
            before = timers["forward"].total
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            per_step.append(dt)
            overhead.append(dt - (timers["forward"].total - before))
    finally:
        model_runner.sample = timers["sample"].fn
        for rid in list(engine.seqs):
            engine.abort_request(rid)
        engine.step()
        del engine.scheduler.schedule, engine.runner.prepare, engine.runner.model.forward, engine.postprocess
    ms = {k: 1000 * v.total / steps for k, v in timers.items()}
    return {
        "num_seqs": num_seqs,
        "step_ms_median": 1000 * statistics.median(per_step),
        "host_overhead_ms_median": 1000 * statistics.median(overhead),
        "breakdown_ms_mean": ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="16,64,256")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--demo-dir", default=None, help="where the demo model lives (default: a temp dir)")
    ap.add_argument("--json", default="bench-out/engine.json")
    args = ap.parse_args()
    root = Path(args.demo_dir or tempfile.mkdtemp(prefix="loraplex-demo-"))
    demo = ensure_demo(root)
    llm = LLM(demo.model_dir, device="cpu", dtype="float32", max_loras=8, max_num_seqs=256,
              max_num_batched_tokens=8192, kv_cache_blocks=4096, max_model_len=512)
    for name, path in demo.adapters.items():
        llm.add_adapter(name, path)
    rows = [measure(llm, list(demo.adapters), int(n), args.steps, seed=int(n)) for n in args.seqs.split(",")]
    print(f"{'seqs':>5} {'step ms':>9} {'host ms':>9} {'sched':>7} {'prepare':>8} {'sample':>7} {'post':>7}")
    for r in rows:
        b = r["breakdown_ms_mean"]
        print(f"{r['num_seqs']:>5} {r['step_ms_median']:>9.2f} {r['host_overhead_ms_median']:>9.2f} "
              f"{b['schedule']:>7.2f} {b['prepare']:>8.2f} {b['sample']:>7.2f} {b['postprocess']:>7.2f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": "cpu", "model": "demo", "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
