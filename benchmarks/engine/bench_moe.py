#!/usr/bin/env python3
"""CPU decode throughput of Mixtral and Qwen3-MoE against the dense model with the same active parameters,
in paired rounds.

Tiny random models of one attention shape (hidden 256, 4 layers, 8 heads over 4 kv heads), each with one
rank-16 adapter on every module PEFT targets in it (the MoE ones on attention and, by target_parameters,
both fused expert weights); the MoE models route each token to 2 of 8 experts of intermediate 384, so a
token's active MLP is 2 x 384 = 768 wide: the dense Llama (against Mixtral) and Qwen3 (against Qwen3-MoE)
have intermediate 768. Every round decodes `--seqs` sequences (half on the adapter, half base) on both of
a pair, the order flipping each round. Issue 37 asks for the number, not a bound: an MoE layer's routing,
per-expert matmuls and grouped LoRA cost host work a dense MLP does not. Medians over rounds, per second of
this process's CPU time (a shared machine's other work does not dilute it) and of wall time.

    .venv/bin/python -m benchmarks.engine.bench_moe --json bench-out/moe-cpu.json
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.engine.bench_int8 import decode_tok_s
from benchmarks.engine.decode_rounds import decode_rounds_parser
from server.demo import SEVEN, make_adapter, make_base_model
from benchmarks.engine.moe_models import make_moe_adapter, make_moe_model
from server.engine import LLM

ATTENTION = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 384
# MoE model -> (its shape over ATTENTION, the dense architecture of the same active parameters)
PAIRS = {
    "mixtral": (dict(num_local_experts=EXPERTS, intermediate_size=EXPERT_WIDTH), "llama"),
    "qwen3_moe": (dict(num_experts=EXPERTS, moe_intermediate_size=EXPERT_WIDTH, head_dim=32), "qwen3"),
}


def build(tmp: Path, name: str, seqs: int) -> LLM:
    if name in PAIRS:
        model_dir = make_moe_model(tmp / name, name, num_experts_per_tok=TOP_K, **ATTENTION, **PAIRS[name][0])
        adapter = make_moe_adapter(model_dir, tmp / f"{name}-lora", 16, 32, ["q_proj", "k_proj", "v_proj", "o_proj"],
                                   ["experts.gate_up_proj", "experts.down_proj"], seed=3)
    else:
        model_dir = make_base_model(tmp / name, name, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                                    intermediate_size=TOP_K * EXPERT_WIDTH)
        adapter = make_adapter(model_dir, tmp / f"{name}-lora", r=16, seed=3, target_modules=SEVEN)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_loras=2, max_lora_rank=16, kv_cache_blocks=8 * seqs,
              max_model_len=128)
    llm.add_adapter("a", adapter)
    decode_tok_s(llm, ["a"], seqs, 2, seed=0, tag=f"warm-{name}")
    return llm


def main() -> None:
    args = decode_rounds_parser(__doc__, "bench-out/moe-cpu.json").parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llms = {name: build(Path(tmp), name, args.seqs) for moe, (_, dense) in PAIRS.items() for name in (moe, dense)}
        rounds = []
        for r in range(args.rounds):
            row = {}
            for moe, (_, dense) in PAIRS.items():
                order = (dense, moe) if r % 2 == 0 else (moe, dense)
                pair = {a: decode_tok_s(llms[a], ["a"], args.seqs, args.steps, seed=r, tag=f"r{r}-{a}") for a in order}
                row[moe] = {"dense": pair[dense], "moe": pair[moe], "ratio_cpu": pair[moe][1] / pair[dense][1],
                            "ratio_wall": pair[moe][0] / pair[dense][0]}
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{m} x{v['ratio_cpu']:.3f}" for m, v in row.items()), flush=True)
    summary = {moe: {"dense": PAIRS[moe][1],
                     "median_ratio_cpu": statistics.median(r[moe]["ratio_cpu"] for r in rounds),
                     "median_ratio_wall": statistics.median(r[moe]["ratio_wall"] for r in rounds),
                     "median_tok_s_cpu": statistics.median(r[moe]["moe"][1] for r in rounds),
                     "dense_median_tok_s_cpu": statistics.median(r[moe]["dense"][1] for r in rounds)}
               for moe in PAIRS}
    for moe, s in summary.items():
        print(f"{moe:>9}: {s['median_tok_s_cpu']:.1f} tok/s (CPU time) vs dense {s['dense']} "
              f"{s['dense_median_tok_s_cpu']:.1f}: x{s['median_ratio_cpu']:.3f} (wall x{s['median_ratio_wall']:.3f})")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"attention": ATTENTION, "experts": EXPERTS, "top_k": TOP_K,
                               "expert_intermediate": EXPERT_WIDTH, "dense_intermediate": TOP_K * EXPERT_WIDTH,
                               "adapter_rank": 16, "device": "cpu", "cpu": platform.processor() or platform.machine(),
                               "load_average": os.getloadavg(), "torch": torch.__version__,
                               "threads": torch.get_num_threads(), "seqs": args.seqs, "steps": args.steps,
                               "rounds": rounds, "summary": summary}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
