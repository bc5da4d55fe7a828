#!/usr/bin/env python3
"""CPU decode throughput of each architecture against Llama's at the same size, in paired rounds.

Tiny random models of one shape (hidden 256, 4 layers, 8 heads over 4 kv heads, intermediate 768; Gemma
with a 16-token window on its sliding layers and its default soft-caps), each with one rank-16 adapter on
every module PEFT targets in it; every round decodes `--seqs` sequences (half on the adapter, half base)
on Llama and on each other architecture, the order flipping each round. Target (issue 37): every dense
architecture's tok/s >= 0.85x Llama's. Medians over rounds, per second of this process's CPU time (a shared
machine's other work does not dilute it) and of wall time.

    .venv/bin/python -m benchmarks.engine.bench_architectures --json bench-out/architectures-cpu.json
"""
from __future__ import annotations

import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.engine.bench_int8 import decode_tok_s
from benchmarks.engine.decode_rounds import decode_rounds_parser
from server.demo import PHI3_MODULES, SEVEN, make_adapter, make_base_model
from server.engine import LLM

SHAPE = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768)
ARCHS = {"llama": {}, "qwen3": {}, "phi3": {},
         "gemma2": dict(sliding_window=16), "gemma3": dict(sliding_window=16, _sliding_window_pattern=2)}


def main() -> None:
    args = decode_rounds_parser(__doc__, "bench-out/architectures-cpu.json").parse_args()
    llms = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, overrides in ARCHS.items():
            model_dir = make_base_model(Path(tmp) / arch, arch, config_overrides=overrides, **SHAPE)
            adapter = make_adapter(model_dir, Path(tmp) / f"{arch}-lora", r=16, seed=3,
                                   target_modules=PHI3_MODULES if arch == "phi3" else SEVEN)
            llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=2, max_lora_rank=16,
                      kv_cache_blocks=8 * args.seqs, max_model_len=128)
            llm.add_adapter("a", adapter)
            decode_tok_s(llm, ["a"], args.seqs, 2, seed=0, tag=f"warm-{arch}")
            llms[arch] = llm
        rounds = []
        for r in range(args.rounds):
            row = {}
            for arch in [a for a in ARCHS if a != "llama"]:
                order = ("llama", arch) if r % 2 == 0 else (arch, "llama")
                pair = {a: decode_tok_s(llms[a], ["a"], args.seqs, args.steps, seed=r, tag=f"r{r}-{a}") for a in order}
                row[arch] = {"llama": pair["llama"], "arch": pair[arch],
                             "ratio_cpu": pair[arch][1] / pair["llama"][1], "ratio_wall": pair[arch][0] / pair["llama"][0]}
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{a} x{v['ratio_cpu']:.3f}" for a, v in row.items()), flush=True)
    summary = {arch: {"median_ratio_cpu": statistics.median(r[arch]["ratio_cpu"] for r in rounds),
                      "median_ratio_wall": statistics.median(r[arch]["ratio_wall"] for r in rounds),
                      "median_tok_s_cpu": statistics.median(r[arch]["arch"][1] for r in rounds),
                      "llama_median_tok_s_cpu": statistics.median(r[arch]["llama"][1] for r in rounds)}
               for arch in rounds[0]}
    for arch, s in summary.items():
        print(f"{arch:>7}: {s['median_tok_s_cpu']:.1f} tok/s (CPU time) vs llama {s['llama_median_tok_s_cpu']:.1f}: "
              f"x{s['median_ratio_cpu']:.3f} (wall x{s['median_ratio_wall']:.3f}; target >= 0.85)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": SHAPE, "archs": ARCHS, "device": "cpu",
                               "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                               "threads": torch.get_num_threads(), "seqs": args.seqs, "steps": args.steps,
                               "rounds": rounds, "summary": summary}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
