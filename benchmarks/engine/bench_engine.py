#!/usr/bin/env python3
"""Host-side time per engine step outside the model forward, at 16/64/256 running sequences.

On a GPU this overhead (scheduling, block tables, adapter metadata, sampling
bookkeeping), not the math, decides small-batch speed. The outputs' text
(detokenizing, stop strings) is the front end's, in another process when the
engine core runs in its own: timed apart ("front text"), outside the step.
Prints a table and writes JSON.

With --prefix-cache it measures the prefix cache's bookkeeping instead, where
it buys nothing: every prompt distinct (no hits), each batch run from admission
to its last token with the cache off and on, and the time inside the cache's
calls (lookup at admission, hashing and indexing of every block once full)
taken as a share of step time.

    .venv/bin/python -m benchmarks.engine.bench_engine --json bench-out/engine.json
    .venv/bin/python -m benchmarks.engine.bench_engine --cpu-time --seqs 256 --steps 100 --json bench-out/engine-cpu.json
    .venv/bin/python -m benchmarks.engine.bench_engine --prefix-cache --seqs 16,64 --json bench-out/prefix-cost.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.profile.step_phases import Timer, timed_phases
from server.demo import ensure_demo
from server.engine import LLM, SamplingParams
from server.engine.output_text import OutputTexts


def measure(llm: LLM, adapters: list[str], num_seqs: int, steps: int, seed: int,
            clock=time.perf_counter) -> dict:
    engine = llm.engine
    rng = random.Random(seed)
    texts = OutputTexts(engine.detokenizer, engine.abort_choice)  # the front end's share
    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(8, 32))]
        name = adapters[i % (len(adapters) + 1)] if i % (len(adapters) + 1) < len(adapters) else None
        engine.add_request(f"b{num_seqs}-{i}", prompt, params, llm._versions[name] if name else None)
        texts.add(f"b{num_seqs}-{i}", params)
    while engine.stats().scheduler.running < num_seqs or any(
        s.num_pending_tokens > 1 for s in engine.scheduler.running
    ):
        texts.apply(engine.step())  # until every sequence is decoding
    per_step, overhead, front = [], [], []
    with timed_phases(engine, clock) as timers:
        try:
            for _ in range(steps):
                before = timers["forward"].total
                t = clock()
                outputs = engine.step()
                dt = clock() - t
                per_step.append(dt)
                overhead.append(dt - (timers["forward"].total - before))
                t = clock()
                texts.apply(outputs)
                front.append(clock() - t)
        finally:
            for rid in list(engine.seqs):
                engine.abort_request(rid)
            engine.step()
    ms = {k: 1000 * v.total / steps for k, v in timers.items()}
    return {
        "num_seqs": num_seqs,
        "step_ms_median": 1000 * statistics.median(per_step),
        "host_overhead_ms_median": 1000 * statistics.median(overhead),
        "breakdown_ms_mean": ms,
        # Host time in the step outside the four host phases (results, copies, the step's own calls): the
        # mean overhead less their means.
        "remaining_ms_mean": 1000 * statistics.fmean(overhead) - sum(v for k, v in ms.items() if k != "forward"),
        "front_end_text_ms_mean": 1000 * statistics.fmean(front),
    }


PREFIX_CACHE_CALLS = ("lookup", "admitted", "register")


def _run_batch(llm: LLM, adapters: list[str], num_seqs: int, prompt_len: int, max_tokens: int,
               rng: random.Random, tag: str) -> tuple[list[float], float]:
    """Distinct prompts from admission to the last token: (each step's seconds, seconds in cache calls)."""
    engine = llm.engine
    cache = engine.scheduler.prefix_cache
    timers = {name: Timer(getattr(cache, name)) for name in PREFIX_CACHE_CALLS}
    for name, timer in timers.items():
        setattr(cache, name, timer)  # shadows the method on this instance only
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        name = adapters[i % len(adapters)] if i % (len(adapters) + 1) < len(adapters) else None
        prompt = [rng.randrange(3, 500) for _ in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", prompt, params, llm._versions[name] if name else None, tenant=f"t{i % 4}")
    steps = []
    try:
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
    finally:
        for name in timers:
            delattr(cache, name)
    return steps, sum(t.total for t in timers.values())


def measure_prefix_cost(llm: LLM, adapters: list[str], num_seqs: int, prompt_len: int, max_tokens: int,
                        repeats: int, seed: int) -> dict:
    """Cache off and on, alternating, `repeats` times each; the fastest run of each is kept."""
    engine = llm.engine
    rng = random.Random(seed)
    runs: dict[bool, list[tuple[list[float], float, int]]] = {False: [], True: []}
    for r in range(repeats):
        for cache in (False, True):
            engine.set_prefix_cache_policy(cache)
            before = engine.stats().prefix_cache.hit_tokens
            steps, book = _run_batch(llm, adapters, num_seqs, prompt_len, max_tokens, rng, f"p{num_seqs}-{r}-{cache}")
            runs[cache].append((steps, book, engine.stats().prefix_cache.hit_tokens - before))
    row = {"num_seqs": num_seqs, "prompt_len": prompt_len, "max_tokens": max_tokens, "repeats": repeats}
    for cache, key in ((False, "off"), (True, "on")):
        steps, book, hits = min(runs[cache], key=lambda run: sum(run[0]))
        row[key] = {"steps": len(steps), "total_s": sum(steps), "step_ms_median": 1000 * statistics.median(steps),
                    "bookkeeping_s": book, "bookkeeping_share": book / sum(steps), "hit_tokens": hits}
    row["total_ratio_on_over_off"] = row["on"]["total_s"] / row["off"]["total_s"]
    return row


def prefix_main(args, llm: LLM, adapters: list[str]) -> None:
    rows = [measure_prefix_cost(llm, adapters, int(n), args.prompt_len, args.max_tokens, args.repeats, seed=int(n))
            for n in args.seqs.split(",")]
    print(f"{'seqs':>5} {'cache':>5} {'steps':>6} {'total s':>8} {'step ms':>8} {'cache ms':>9} {'share':>7} "
          f"{'hits':>5}")
    for r in rows:
        for key in ("off", "on"):
            c = r[key]
            print(f"{r['num_seqs']:>5} {key:>5} {c['steps']:>6} {c['total_s']:>8.3f} {c['step_ms_median']:>8.2f} "
                  f"{1000 * c['bookkeeping_s']:>9.2f} {c['bookkeeping_share']:>7.2%} {c['hit_tokens']:>5}")
        print(f"{'':>5} on/off total time x{r['total_ratio_on_over_off']:.3f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": "cpu", "model": "demo", "prefix_cache_cost": rows}, indent=2))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="16,64,256")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--demo-dir", default=None, help="where the demo model lives (default: a temp dir)")
    ap.add_argument("--json", default="bench-out/engine.json")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the step thread's CPU time, not wall time: on a shared machine, the host work "
                         "without the waits for a core (the forward's other torch threads are not counted)")
    ap.add_argument("--prefix-cache", action="store_true", help="measure the prefix cache's cost with no hits")
    ap.add_argument("--prompt-len", type=int, default=512, help="with --prefix-cache: tokens per prompt")
    ap.add_argument("--max-tokens", type=int, default=32, help="with --prefix-cache: output tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="with --prefix-cache: runs of each, the fastest kept")
    args = ap.parse_args()
    root = Path(args.demo_dir or tempfile.mkdtemp(prefix="loraplex-demo-"))
    demo = ensure_demo(root)
    llm = LLM(demo.model_dir, device="cpu", dtype="float32", max_loras=8, max_num_seqs=256,
              max_num_batched_tokens=8192, kv_cache_blocks=4096, max_model_len=1024)
    for name, path in demo.adapters.items():
        llm.add_adapter(name, path)
    if args.prefix_cache:
        prefix_main(args, llm, list(demo.adapters))
        return
    clock = time.thread_time if args.cpu_time else time.perf_counter
    rows = [measure(llm, list(demo.adapters), int(n), args.steps, seed=int(n), clock=clock)
            for n in args.seqs.split(",")]
    print(f"{'seqs':>5} {'step ms':>9} {'host ms':>9} {'sched':>7} {'prepare':>8} {'sample':>7} {'post':>7} {'front text':>10}")
    for r in rows:
        b = r["breakdown_ms_mean"]
        print(f"{r['num_seqs']:>5} {r['step_ms_median']:>9.2f} {r['host_overhead_ms_median']:>9.2f} "
              f"{b['schedule']:>7.2f} {b['prepare']:>8.2f} {b['sample']:>7.2f} {b['postprocess']:>7.2f} "
              f"{r['front_end_text_ms_mean']:>10.2f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": "cpu", "model": "demo", "clock": "thread_cpu" if args.cpu_time else "wall",
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
