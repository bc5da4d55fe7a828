#!/usr/bin/env python3
"""Time of one sampling step (server.engine.sampler.sample_rows) for a batch of rows, on CPU.

What each OpenAI sampling feature adds to the plain step: logprobs, the
penalties (presence, frequency, repetition over a prompt and an output so
far), and everything at once (also logit_bias, min_tokens, top_k, min_p).
Greedy cases are compared with plain greedy, sampled ones with plain
temperature + top_p. Prints a table of medians and writes JSON.

    .venv/bin/python -m benchmarks.engine.bench_sampling --json docs/benchmarks/sampling-cpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from server.engine.sampler import SamplingRow, sample_rows
from server.engine.sequence import SamplingParams

GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.8, top_p=0.95)
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)


def cases(vocab: int) -> dict[str, tuple[str, dict]]:
    """name -> (baseline name, SamplingParams fields)."""
    rng = random.Random(0)
    everything = dict(**SAMPLED, **PENALTIES, logprobs=5, top_k=50, min_p=0.05, min_tokens=200, max_tokens=256,
                      logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(10)})
    return {
        "greedy": ("greedy", GREEDY),
        "greedy + logprobs=5": ("greedy", dict(**GREEDY, logprobs=5)),
        "greedy + penalties": ("greedy", dict(**GREEDY, **PENALTIES)),
        "temperature+top_p": ("temperature+top_p", SAMPLED),
        "temperature+top_p seeded": ("temperature+top_p", dict(**SAMPLED, seed=1)),
        "temperature+top_p + logprobs=5": ("temperature+top_p", dict(**SAMPLED, logprobs=5)),
        "temperature+top_p + penalties": ("temperature+top_p", dict(**SAMPLED, **PENALTIES)),
        "all": ("temperature+top_p", everything),
    }


def measure(vocab: int, rows_n: int, params: SamplingParams, prompt_len: int, output_len: int, iters: int,
            seed: int) -> float:
    """Median milliseconds of one sample_rows call over `iters` calls."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows_n, vocab, generator=g) * 4  # [N, V]
    rng = random.Random(seed)
    rows = []
    for i in range(rows_n):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g)  # [P], cached per request in the engine
        output = [rng.randrange(vocab) for _ in range(output_len)]
        rows.append(SamplingRow(params, 0, output_len, output if params.has_penalties else (),
                                prompt if params.repetition_penalty != 1.0 else None,
                                (2,) if output_len < params.min_tokens else ()))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        sample_rows(logits, rows, gen)  # warm-up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        sample_rows(logits, rows, gen)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocabs", default="32000,128256")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", default="bench-out/sampling-cpu.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        medians: dict[str, float] = {}
        for name, (baseline, fields) in cases(vocab).items():
            ms = measure(vocab, args.rows, SamplingParams(**fields), args.prompt_len, args.output_len, args.iters,
                         seed=vocab)
            medians[name] = ms
            results.append({"vocab": vocab, "case": name, "median_ms": round(ms, 3), "baseline": baseline,
                            "ratio": round(ms / medians[baseline], 2)})
    print(f"{'vocab':>7}  {'case':<32} {'median ms':>10} {'x baseline':>10}")
    for r in results:
        print(f"{r['vocab']:>7}  {r['case']:<32} {r['median_ms']:>10.2f} {r['ratio']:>10.2f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.machine(), "rows": args.rows, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "iters": args.iters, "results": results,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
