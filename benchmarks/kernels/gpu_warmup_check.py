"""GPU runbook step 4: warm-up compiles every Triton variant, and serving then compiles none.

Builds the Llama-3-8B-shaped random model in tmpfs, starts the engine on CUDA (its warm-up compiles
every kernel variant), then serves prefill, chunked-prefill and decode steps with no adapter and with
adapters of the smallest and largest rank, counting the entries Triton adds to its cache meanwhile.
Exits 1 if any were compiled while serving. Needs TRITON_CACHE_DIR set to an empty directory.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from server.bench.gpu_model import make_llama3_8b_shaped
from server.bench.synth_adapters import write_adapter
from server.engine import LLM, SamplingParams


def cache_entries(cache: str) -> int:
    return sum(len(files) for _, _, files in os.walk(cache))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=None, help="fewer layers of the 8B widths")
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--model-dir", default="/dev/shm/loraplex-warmup-8b")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache:
        print("set TRITON_CACHE_DIR to an empty directory", file=sys.stderr)
        return 2
    model = make_llama3_8b_shaped(args.model_dir, num_layers=args.layers)
    t = time.perf_counter()
    llm = LLM(str(model), device="cuda", dtype="bfloat16", max_loras=8, max_lora_rank=args.max_lora_rank)
    print(f"engine start {time.perf_counter() - t:.1f} s, of which warm-up {llm.engine.warmup_seconds:.1f} s")
    with tempfile.TemporaryDirectory() as tmp:
        for r in (8, args.max_lora_rank):
            llm.add_adapter(f"r{r}", write_adapter(model, Path(tmp) / f"r{r}", r=r, seed=r))
    before = cache_entries(cache)
    # Lengths 1..2332 give decode-only, prefill and chunked-prefill steps (4096 batched tokens a step).
    prompts = [[5 + i % 400] * (1 + 37 * i) for i in range(64)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    counts = {}
    for label, adapters in (("no adapter", None), ("ranks 8 and max", [None, "r8", f"r{args.max_lora_rank}"] * 21 + [None])):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, adapters)
        assert all(len(o.token_ids) == 32 for o in outs)
        counts[label] = cache_entries(cache) - before
        print(f"{label}: {len(prompts)} requests in {time.perf_counter() - t:.1f} s, "
              f"compiled while serving: {counts[label]}")
    return 0 if not any(counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
