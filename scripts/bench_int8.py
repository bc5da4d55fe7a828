#!/usr/bin/env python3
"""Decode tokens/s with int8 weight-only base projections against float32, in the same run.

Three variants: float32; "int8", the engine's own choice of int8 matmul for this CPU
(kernels.int8_weights.int8_linear_for); and "int8pack", torch's `aten._weight_int8pack_mm` forced,
to show the measurement behind that choice. The smol135 shape (server.bench.model_shape), one
engine per variant, `--seqs` decoding sequences spread over `--adapters` adapter slots (one LoRA
file loaded under each name: every slot is its own adapter to the kernels, which is what costs).
Rounds alternate the variants (the order flips each round) so a machine shared with other work loads both alike; each round times `--steps`
decode steps per variant and the table reports the median of the per-round ratios. Prints a table
and writes JSON.

    .venv/bin/python scripts/bench_int8.py --json docs/benchmarks/int8-cpu.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels.int8_weights import int8pack_linear  # noqa: E402
from server.bench.model_shape import build_model_shape  # noqa: E402
from server.demo import make_adapter  # noqa: E402
from server.engine import LLM, SamplingParams  # noqa: E402

VARIANTS = {"float32": None, "int8": "int8", "int8pack": "int8"}


def decode_tok_s(llm: LLM, adapters: list[str], num_seqs: int, steps: int, seed: int, tag: str) -> float:
    """Tokens per second over `steps` steps in which every sequence decodes (prefill excluded)."""
    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, 500) for _ in range(16)]
        engine.add_request(f"{tag}-{i}", prompt, params, llm._versions[adapters[i % len(adapters)]])
    while engine.stats().num_running < num_seqs or any(s.num_pending_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t
    for rid in list(engine.seqs):
        engine.abort_request(rid)
    engine.step()
    return num_seqs * steps / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=8, help="decoding sequences (default 8)")
    ap.add_argument("--adapters", type=int, default=8, help="adapter slots the sequences use (default 8)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per variant per round (default 8)")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (default 5)")
    ap.add_argument("--model-dir", help="where the smol135-shaped model is built or reused (default: a temp dir)")
    ap.add_argument("--json", default="bench-out/int8-cpu.json", help="output (default bench-out/int8-cpu.json)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_shape("smol135", args.model_dir or Path(tmp) / "smol135")
        adapter_dir = make_adapter(model_dir, Path(tmp) / "adapter", r=args.rank, lora_alpha=2 * args.rank)
        names = [f"a{i}" for i in range(args.adapters)]
        llms = {}
        for variant, quantization in VARIANTS.items():
            llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=args.adapters, max_lora_rank=args.rank,
                      kv_cache_blocks=64 * args.seqs // 16 + 16, max_model_len=256, quantization=quantization)
            if variant == "int8pack":
                engine = llm.engine
                engine.kernels = engine.runner.ops = dataclasses.replace(engine.kernels, int8_linear=int8pack_linear)
            for name in names:
                llm.add_adapter(name, adapter_dir)
            decode_tok_s(llm, names, args.seqs, 2, seed=0, tag=f"warm-{variant}")
            llms[variant] = llm
        rounds = []
        for r in range(args.rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            row = {v: decode_tok_s(llms[v], names, args.seqs, args.steps, seed=r, tag=f"r{r}-{v}") for v in order}
            row["ratio"] = row["int8"] / row["float32"]
            row["ratio_int8pack"] = row["int8pack"] / row["float32"]
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{v} {row[v]:.2f} tok/s" for v in VARIANTS)
                  + f"; int8/float32 x{row['ratio']:.3f}", flush=True)
        weight_bytes = {v: sum(lin.weight.nbytes for layer in llms[v].engine.model.layers
                               for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)) for v in ("float32", "int8")}
    summary = {
        "median_tok_s": {v: statistics.median(r[v] for r in rounds) for v in VARIANTS},
        "int8_matmul": llms["int8"].engine.kernels.int8_linear.__name__,
        "median_ratio_int8_over_float32": statistics.median(r["ratio"] for r in rounds),
        "median_ratio_int8pack_over_float32": statistics.median(r["ratio_int8pack"] for r in rounds),
        "projection_weight_bytes": weight_bytes,
        "weight_bytes_ratio": weight_bytes["int8"] / weight_bytes["float32"],
    }
    print(f"\n{'variant':>8} {'tok/s (median)':>15} {'proj. weight MB':>16}")
    for v in VARIANTS:
        mb = weight_bytes["float32" if v == "float32" else "int8"] / 1e6
        print(f"{v:>8} {summary['median_tok_s'][v]:>15.2f} {mb:>16.1f}")
    print(f"int8 ({summary['int8_matmul']})/float32: decode x{summary['median_ratio_int8_over_float32']:.3f}, "
          f"int8pack/float32 x{summary['median_ratio_int8pack_over_float32']:.3f} (medians of {args.rounds} paired "
          f"rounds); weight bytes x{summary['weight_bytes_ratio']:.3f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": "smol135 shape (random weights)", "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "seqs": args.seqs, "adapters": args.adapters, "rank": args.rank, "steps": args.steps,
        "rounds": rounds, **summary,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
