#!/usr/bin/env python3
"""Decode tokens/s with int8 (and int4) weight-only base projections against float32, in the same run.

Five variants (`--variants` picks some; float32 always runs): float32; "int8", the engine's own
choice of int8 matmul for this CPU (kernels.int8_weights.int8_linear_for: on an AVX2-only CPU,
kernels.int8_avx2's kernel); "int8_lm_head", the same with the lm_head in int8 too
(`quantize_lm_head`); and "dequant", the int8 engine forced onto dequant_linear (the fallback where
the AVX2 kernel cannot be built); "int4", groups of 32 (kernels.int4_weights, on an AVX2 CPU
kernels.int4_avx2's kernel). The smol135 shape (benchmarks.model_shape), one engine per variant, `--seqs` decoding
sequences spread over `--adapters` adapter slots (one LoRA file loaded under each name: every slot
is its own adapter to the kernels, which is what costs). Rounds alternate the variants (the order
flips each round) so a machine shared with other work loads all alike; each round times `--steps`
decode steps per variant and the table reports the median of the per-round ratios, of wall-clock
tok/s and of tok/s per second of process CPU time (which other work on a shared machine does not
dilute). First, the projections alone at `--projection-tokens` rows, in CPU ms. The load average
before and after goes into the JSON. Prints a table and writes JSON.

    .venv/bin/python -m benchmarks.engine.bench_int8 --json docs/benchmarks/int8-cpu.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.model_shape import build_model_shape
from kernels.int4_weights import Int4Weight
from kernels.int8_weights import Int8Weight, dequant_linear
from server.demo import make_adapter
from server.engine import LLM, SamplingParams

VARIANTS = {"float32": {}, "int8": {"quantization": "int8"},
            "int8_lm_head": {"quantization": "int8", "quantize_lm_head": True}, "dequant": {"quantization": "int8"},
            "int4": {"quantization": "int4"}}


def decode_tok_s(llm: LLM, adapters: list[str], num_seqs: int, steps: int, seed: int,
                 tag: str) -> tuple[float, float]:
    """Tokens per second over `steps` steps in which every sequence decodes (prefill excluded): per
    second of wall time, and per second of this process's CPU time (what other work on a shared
    machine does not dilute; at 1 torch thread, what a core of its own would run)."""
    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, 500) for _ in range(16)]
        engine.add_request(f"{tag}-{i}", prompt, params, llm._versions[adapters[i % len(adapters)]])
    while engine.stats().scheduler.running < num_seqs or any(
            s.num_pending_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.step()
    dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
    for rid in list(engine.seqs):
        engine.abort_request(rid)
    engine.step()
    return num_seqs * steps / dt, num_seqs * steps / dcpu


def projections_ms(llm: LLM, tokens: int, seed: int) -> float:
    """CPU ms (this process's) for one pass of every decoder projection's base matmul (no LoRA, no
    bias) at `tokens` rows, through the engine's own kernel entry: what the int8 choice changes in a step."""
    ops = llm.engine.kernels
    lins = [lin for layer in llm.engine.model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    g = torch.Generator().manual_seed(seed)
    xs = {n_in: torch.randn(tokens, n_in, generator=g) for n_in in {lin.weight.shape[1] for lin in lins}}
    outs = {n_out: torch.empty(tokens, n_out) for n_out in {lin.weight.shape[0] for lin in lins}}
    t = time.process_time()
    for lin in lins:
        n_out, n_in = lin.weight.shape
        if isinstance(lin.weight, Int8Weight):
            ops.int8_linear(xs[n_in], lin.weight, None, out=outs[n_out], scratch=lin.dequant_scratch)
        elif isinstance(lin.weight, Int4Weight):
            ops.int4_linear(xs[n_in], lin.weight, None, out=outs[n_out])
        else:
            ops.linear(xs[n_in], lin.weight, None, out=outs[n_out])
    return 1000 * (time.process_time() - t)


def paired_projections(llms: dict[str, LLM], tokens: int, rounds: int) -> dict:
    """Median ms per variant and median per-round ratios to float32, the order flipping each round."""
    rows = []
    for r in range(rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        rows.append({v: projections_ms(llms[v], tokens, seed=r) for v in order})
    return {"tokens": tokens, "median_cpu_ms": {v: statistics.median(row[v] for row in rows) for v in llms},
            "median_speedup_over_float32": {v: statistics.median(row["float32"] / row[v] for row in rows)
                                            for v in llms if v != "float32"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=8, help="decoding sequences (default 8)")
    ap.add_argument("--adapters", type=int, default=8, help="adapter slots the sequences use (default 8)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per variant per round (default 8)")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (default 5)")
    ap.add_argument("--projection-tokens", default="1,8,32",
                    help="token rows at which the projections alone are timed, comma-separated (default 1,8,32)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, float32 always included (default {','.join(VARIANTS)})")
    ap.add_argument("--model-dir", help="where the smol135-shaped model is built or reused (default: a temp dir)")
    ap.add_argument("--json", default="bench-out/int8-cpu.json", help="output (default bench-out/int8-cpu.json)")
    args = ap.parse_args()
    variants = ["float32", *(v for v in args.variants.split(",") if v != "float32")]
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    quantized = variants[1:]

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_shape("smol135", args.model_dir or Path(tmp) / "smol135")
        adapter_dir = make_adapter(model_dir, Path(tmp) / "adapter", r=args.rank, lora_alpha=2 * args.rank)
        names = [f"a{i}" for i in range(args.adapters)]
        llms = {}
        for variant in variants:
            llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=args.adapters, max_lora_rank=args.rank,
                      kv_cache_blocks=64 * args.seqs // 16 + 16, max_model_len=256, **VARIANTS[variant])
            if variant == "dequant":
                engine = llm.engine
                engine.kernels = engine.runner.ops = dataclasses.replace(engine.kernels, int8_linear=dequant_linear)
            for name in names:
                llm.add_adapter(name, adapter_dir)
            decode_tok_s(llm, names, args.seqs, 2, seed=0, tag=f"warm-{variant}")
            llms[variant] = llm
        load_before = os.getloadavg()
        projections = [paired_projections(llms, int(n), args.rounds) for n in args.projection_tokens.split(",")]
        for p in projections:
            times = ", ".join(f"{v} {ms:.1f}" for v, ms in p["median_cpu_ms"].items())
            speedups = ", ".join(f"{v} x{x:.2f}" for v, x in p["median_speedup_over_float32"].items())
            print(f"projections at {p['tokens']} rows (CPU ms): {times}; float32's / variant's: {speedups}", flush=True)
        rounds = []
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            row = {}
            for v in order:
                row[v], row[f"{v}_cpu"] = decode_tok_s(llms[v], names, args.seqs, args.steps, seed=r, tag=f"r{r}-{v}")
            for v in quantized:
                row[f"ratio_{v}"] = row[v] / row["float32"]
                row[f"ratio_{v}_cpu"] = row[f"{v}_cpu"] / row["float32_cpu"]
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{v} {row[v]:.2f} tok/s" for v in variants) + "; over float32: "
                  + ", ".join(f"{v} x{row[f'ratio_{v}']:.3f} (CPU time x{row[f'ratio_{v}_cpu']:.3f})"
                              for v in quantized), flush=True)
        load_after = os.getloadavg()
        weight_bytes = {v: sum(lin.weight.nbytes for layer in llms[v].engine.model.layers
                               for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)) for v in variants}
        lm_head_bytes = {v: llms[v].engine.model.lm_head.nbytes for v in variants}
        int8_matmul = next((llms[v].engine.kernels.int8_linear.__name__ for v in quantized
                            if v.startswith("int8")), None)
        int4_matmul = llms["int4"].engine.kernels.int4_linear.__name__ if "int4" in llms else None
    summary = {
        "median_tok_s": {v: statistics.median(r[v] for r in rounds) for v in variants},
        "median_tok_per_cpu_s": {v: statistics.median(r[f"{v}_cpu"] for r in rounds) for v in variants},
        "int8_matmul": int8_matmul,
        "int4_matmul": int4_matmul,
        "median_ratio_over_float32": {v: statistics.median(r[f"ratio_{v}"] for r in rounds) for v in quantized},
        "median_cpu_time_ratio_over_float32": {v: statistics.median(r[f"ratio_{v}_cpu"] for r in rounds)
                                               for v in quantized},
        "projection_weight_bytes": weight_bytes,
        "lm_head_weight_bytes": lm_head_bytes,
        "weight_bytes_ratio": {v: weight_bytes[v] / weight_bytes["float32"] for v in quantized},
    }
    print(f"\n{'variant':>12} {'tok/s (median)':>15} {'tok/CPU s':>10} {'x float32':>10} {'x per CPU s':>12} "
          f"{'proj. MB':>9} {'lm_head MB':>11}")
    for v in variants:
        ratio, ratio_cpu = (f"x{summary[k][v]:.3f}" if v in quantized else "" for k in
                            ("median_ratio_over_float32", "median_cpu_time_ratio_over_float32"))
        print(f"{v:>12} {summary['median_tok_s'][v]:>15.2f} {summary['median_tok_per_cpu_s'][v]:>10.2f} "
              f"{ratio:>10} {ratio_cpu:>12} {weight_bytes[v] / 1e6:>9.1f} {lm_head_bytes[v] / 1e6:>11.1f}")
    print(f"int8 matmul: {int8_matmul}; int4 matmul: {int4_matmul}; medians of {args.rounds} paired rounds; load average "
          f"{load_before[0]:.1f} -> {load_after[0]:.1f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": "smol135 shape (random weights)", "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "seqs": args.seqs, "adapters": args.adapters, "rank": args.rank, "steps": args.steps,
        "load_average_1min": {"before": load_before[0], "after": load_after[0]}, "projections": projections,
        "rounds": rounds, **summary,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
